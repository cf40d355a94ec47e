"""flashwrite.transformers and the Trainer's best model: ``best_model_checkpoint``,
``load_best_model_at_end``, ``save_strategy="best"`` and ``save_total_limit`` rotation, with
the real ``transformers.Trainer`` (run the same way with its own checkpoints) as the reference."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate")

from flashwrite.integrations import transformers as fwt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(_TESTS_FILE)))
import transformers_child as child  # noqa: E402
from transformers_child import Plain  # noqa: E402


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _Snapshots(transformers.TrainerCallback):
    """The model's weights at each evaluation (what the checkpoint of that step holds: the
    Trainer evaluates, then saves), and, with ``check``, the checkpoints on disk after each
    save has committed."""

    def __init__(self, check=False):
        self.trainer = None
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.check = check
        self.seen: list[list[str]] = []

    def on_evaluate(self, args, state, control, model=None, **kw):
        self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def on_save(self, args, state, control, **kw):
        if self.check:
            if isinstance(self.trainer, fwt.FlashwriteTrainerMixin):
                self.trainer.wait_for_checkpoints()
            self.seen.append(sorted(os.listdir(args.output_dir)))


def _scored(out, scores, cls=fwt.FlashwriteTrainer, model=child.tiny_model, check=False, callbacks=(), **kw):
    """A trainer whose evaluation metric ``score`` (lower is better) at step s is scores[s]."""
    trainer = None

    def metrics(_pred):
        return {"score": scores[trainer.state.global_step]}

    snaps = _Snapshots(check)
    args = dict(max_steps=max(scores), save_steps=2, eval_steps=2, eval_strategy="steps",
                metric_for_best_model="score", greater_is_better=False)
    args.update(kw)
    trainer = cls(model=model(), args=child.tiny_args(str(out), **args), train_dataset=child.tiny_data(),
                  eval_dataset=child.tiny_data(4), compute_metrics=metrics, callbacks=[snaps, *callbacks])
    snaps.trainer = trainer
    return trainer, snaps


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _both(tmp_path, scores, **kw):
    """(ours, theirs): the same run with flashwrite's checkpoints and with the Trainer's."""
    runs = []
    for name, cls in (("flashwrite", fwt.FlashwriteTrainer), ("trainer", transformers.Trainer)):
        trainer, snaps = _scored(tmp_path / name, scores, cls=cls, check=True, **kw)
        trainer.train()
        best = trainer.state.best_model_checkpoint
        runs.append((trainer, snaps, None if best is None else os.path.basename(best),
                     sorted(os.listdir(tmp_path / name))))
    return runs


# Scores by step (lower is better). EARLY: the best is the first evaluation; LAST: the best
# is the last save; RISING: every save is the best so far; MIDDLE: the best is neither.
EARLY = {2: 1.0, 4: 3.0, 6: 2.0, 8: 4.0}
LAST = {2: 3.0, 4: 2.0, 6: 4.0, 8: 1.0}
RISING = {2: 4.0, 4: 3.0, 6: 2.0, 8: 1.0}
MIDDLE = {2: 3.0, 4: 1.0, 6: 2.0, 8: 4.0}


@pytest.mark.parametrize("scores,limit,best", [(EARLY, 2, 2), (EARLY, 1, 2), (LAST, 2, 8), (RISING, 2, 8),
                                               (MIDDLE, 1, 4)],
                         ids=["early-best-limit2", "early-best-limit1", "last-best-limit2", "rising-limit2",
                              "middle-best-limit1"])
def test_load_best_model_at_end_with_rotation_ends_on_the_best(tmp_path, scores, limit, best):
    """best_model_checkpoint, what rotation keeps after every commit and at the end, and the
    model train() leaves in the trainer are the Trainer's own; that model holds, byte for
    byte, the weights of the best step."""
    (ours, snaps, name, listing), (_, their_snaps, their_name, their_listing) = _both(
        tmp_path, scores, load_best_model_at_end=True, save_total_limit=limit)
    assert name == their_name == f"checkpoint-{best}"
    assert snaps.seen == their_snaps.seen
    kept = [f"checkpoint-{best}" in s for s in snaps.seen]  # once saved, never rotated away
    assert kept == sorted(kept) and kept[-1]
    assert listing == their_listing
    assert _same(ours.model.state_dict(), snaps.weights[best])
    if best != max(scores):
        assert not _same(ours.model.state_dict(), snaps.weights[max(scores)])


def test_save_strategy_best_records_and_loads_the_best(tmp_path):
    """save_strategy="best" saves only when the metric improves, so the checkpoint saved is
    always the best one: it is recorded, kept and loaded at the end."""
    (ours, snaps, name, listing), (_, _, their_name, their_listing) = _both(
        tmp_path, MIDDLE, save_strategy="best", load_best_model_at_end=True)
    assert name == their_name == "checkpoint-4"
    assert listing == their_listing == ["checkpoint-2", "checkpoint-4"]
    assert _same(ours.model.state_dict(), snaps.weights[4])
    assert not _same(ours.model.state_dict(), snaps.weights[8])


def test_a_plain_module_ends_on_its_best_model(tmp_path):
    """A model that is not a PreTrainedModel: load_best_model_at_end loads the best step's
    weights (the Trainer's own loader would read the index of the whole training state)."""
    trainer, snaps = _scored(tmp_path, EARLY, model=Plain, load_best_model_at_end=True, save_total_limit=2)
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-8"]
    assert _same(trainer.model.state_dict(), snaps.weights[2])
    assert not _same(trainer.model.state_dict(), snaps.weights[8])


class _HoldLastCommit(transformers.TrainerCallback):
    """At the last save, occupy the writer's commit thread until someone waits for the
    checkpoints (``wait_for_checkpoints``) or training has ended (``on_train_end``): a commit
    slower than the rest of training, deterministically."""

    def __init__(self, trainer):
        self.gate = threading.Event()
        self.trainer = trainer
        waits = trainer.wait_for_checkpoints

        def wait_for_checkpoints():
            self.gate.set()
            waits()
        trainer.wait_for_checkpoints = wait_for_checkpoints
        trainer.add_callback(self)

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == args.max_steps - 1:
            self.trainer._fw_writer._committer().submit(self.gate.wait, 20)

    def on_train_end(self, args, state, control, **kw):
        self.gate.set()


def test_save_total_limit_1_leaves_only_the_best_once_train_returns(tmp_path):
    """save_total_limit=1 with a best checkpoint other than the last: the Trainer deletes the
    last one at the end of training. Its save, still in flight then, must not reappear."""
    trainer, _ = _scored(tmp_path, EARLY, save_total_limit=1)
    hold = _HoldLastCommit(trainer)
    try:
        trainer.train()
    finally:
        hold.gate.set()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]


def test_a_best_checkpoint_in_flight_at_the_next_save_is_recorded_and_kept(tmp_path):
    """The best checkpoint (step 2) still in flight when the next save (step 4) starts: it
    is recorded by then, as the Trainer (whose step-2 directory exists by then) has it, and
    save_total_limit=1 rotation after step 4's commit must not delete it."""
    trainer, snaps = _scored(tmp_path, EARLY, save_total_limit=1, load_best_model_at_end=True)
    gate = threading.Event()
    recorded = {}

    class HoldFromStep2(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:  # step 2's commit queues behind this
                trainer._fw_writer._committer().submit(gate.wait, 20)

    record = trainer._fw_record_best

    def record_then_release(run_dir):
        record(run_dir)
        if trainer.state.global_step == 4:
            recorded[4] = (trainer.state.best_model_checkpoint, os.path.exists(tmp_path / "checkpoint-2"))
            gate.set()
    trainer._fw_record_best = record_then_release
    trainer.add_callback(HoldFromStep2())
    try:
        trainer.train()
    finally:
        gate.set()
    assert recorded[4] == (str(tmp_path / "checkpoint-2"), False)  # recorded while still in flight
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]
    assert _same(trainer.model.state_dict(), snaps.weights[2])
