"""Hugging Face ``transformers.Trainer`` checkpoints through flashwrite, asynchronously.

One line in the user's script::

    from flashwrite.transformers import FlashwriteTrainer as Trainer

or, for a subclass of Trainer (TRL's ``SFTTrainer``, your own)::

    SFTTrainer = flashwrite.transformers.with_flashwrite(SFTTrainer)

Every ``save_steps`` checkpoint then is one flashwrite checkpoint, ``output_dir/checkpoint-N``:
the model (any ``nn.Module``) in the ``hf_model=`` layout, under its own names in the shards
that ``model.safetensors.index.json`` lists, with a PreTrainedModel's ``config.json`` and
``generation_config.json`` as ``save_pretrained`` writes them (``from_pretrained("checkpoint-N")``, transformers'
``load_sharded_checkpoint`` and the Trainer's own loaders read it; there is no single
``model.safetensors``: docs/transformers.md says why), the optimizer, LR scheduler, gradient scaler
and RNG states (python, numpy, torch, CUDA) in ``state-*`` stripes beside them, and ``trainer_state.json``,
``training_args.bin`` and the tokenizer's files, written the Trainer's way, inside the same
atomic commit (``extra_files=``). The training loop waits only for the state to be staged in
host memory; writing goes on while it trains. At most one save is in flight; the next one,
the end of ``train()``, loading the best model, a push to the Hub and interpreter exit wait
for it (a failure is logged when it happens and raised by the next wait).
``save_total_limit`` rotation runs (the Trainer's own ``rotate_checkpoints``) once each save
has committed, so a checkpoint in flight is never a candidate and never counted; a checkpoint
is never visible before it is whole, so ``resume_from_checkpoint=True`` finds the newest
committed one. Resuming loads the model, optimizer, scheduler, scaler and RNG states from it.
The best model is the Trainer's: ``best_model_checkpoint`` counts the checkpoint being saved
(still in flight) as the Trainer's does, rotation protects it, and ``load_best_model_at_end``
loads its weights through flashwrite, after the saves in flight have committed (so does the
``save_total_limit=1`` clean-up at the end of training).
The staging pool (one per trainer, reused by every save) is reserved in the background after
the first step that does not save, so the first checkpoint does not allocate it in the loop.

Why a Trainer subclass (a mixin) and not a ``TrainerCallback``: a callback's ``on_save`` runs
after the Trainer has already written its checkpoint synchronously with ``torch.save``, so a
callback could only add a second, asynchronous copy or switch saving off and do it all itself,
without the gradient scaler (callbacks are not given the accelerator) and without the Trainer's
rotation and best-model bookkeeping. Worse, resume: the Trainer's ``_load_optimizer_and_scheduler``,
``_load_scaler`` and ``_load_rng_state`` silently skip a checkpoint without their ``.pt`` files,
and a callback is not told which checkpoint is being resumed, so it could not load them; the
optimizer state would be lost without a word. Overriding those methods and ``_save_checkpoint``
gets both halves right. They are private, so ``TESTED_VERSIONS`` names the transformers versions
this was checked against (``pip install flashwrite[transformers]`` pins them), a warning says so
on others, and ``tests/test_transformers.py`` fails when their code changes.

Configurations this does not handle (multi-process, DeepSpeed, FSDP, XLA, SageMaker MP, PEFT
models) fall back to the Trainer's own checkpoints, with one warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import sys
import tempfile
import threading
import warnings
import weakref
from typing import Any

import numpy as np
import torch
import transformers
from transformers import PreTrainedModel, Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from ..format import MANIFEST_NAME
from ..loading.load import load
from ..manager.manager import CheckpointManager
from ..saving.save import Writer

__all__ = ["FlashwriteTrainerMixin", "FlashwriteTrainer", "with_flashwrite", "is_flashwrite_checkpoint",
           "TESTED_VERSIONS"]

log = logging.getLogger("flashwrite")

# transformers versions (major.minor) whose Trainer private methods this module was checked against.
TESTED_VERSIONS = ("5.24",)
TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_NAME = "training_args.bin"
MODEL_KEY = "model"


def is_flashwrite_checkpoint(path: str | os.PathLike | None) -> bool:
    return path is not None and os.path.isfile(os.path.join(path, MANIFEST_NAME))


def _version_tested() -> bool:
    return ".".join(transformers.__version__.split(".")[:2]) in TESTED_VERSIONS


class FlashwriteTrainerMixin:
    """Put before ``Trainer`` (or a subclass of it) in the bases; see the module docstring.

    flashwrite_options: ``Writer`` options (stripes, queue_depth, chunk_bytes, backend,
    direct, max_staging_bytes, copy_threads, local_snapshots, local_dir) and
    ``allow_pickle`` (store optimizer/scheduler values JSON cannot hold by pickling; only
    for trusted storage). ``flashwrite_stats`` lists the ``SaveStats`` of each committed save.
    """

    def __init__(self, *args: Any, flashwrite_options: dict | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not _version_tested():
            warnings.warn(f"flashwrite.transformers was tested with transformers {', '.join(TESTED_VERSIONS)}, "
                          f"not {transformers.__version__}: the Trainer methods it overrides may have changed",
                          RuntimeWarning, stacklevel=2)
        options = dict(flashwrite_options or {})
        self._fw_allow_pickle = bool(options.pop("allow_pickle", False))
        self._fw_writer_options = options
        self._fw_writer: Writer | None = None
        self._fw_managers: dict[str, CheckpointManager] = {}
        self._fw_resume: tuple[str, dict] | None = None
        self._fw_warned = self._fw_warned_layout = False
        self.flashwrite_stats: list = []
        self.add_callback(_ReservePool(self))
        _LIVE.add(self)

    # ------------------------------------------------------------------ saving

    def _fw_unsupported(self) -> str | None:
        """Why this run's checkpoints go the Trainer's own way, or None."""
        from transformers.trainer import _is_peft_model, is_sagemaker_mp_enabled, is_torch_xla_available
        if self.args.world_size > 1:
            return "multi-process training"
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return "DeepSpeed/FSDP"
        if is_torch_xla_available() or is_sagemaker_mp_enabled():
            return "XLA/SageMaker model parallelism"
        if _is_peft_model(self.model):
            return "PEFT models (adapters)"
        return None

    def _fw_writer_for_saves(self) -> Writer:
        if self._fw_writer is None:
            self._fw_writer = Writer(**self._fw_writer_options)
        return self._fw_writer

    def _fw_manager(self, run_dir: str) -> CheckpointManager:
        mgr = self._fw_managers.get(run_dir)
        if mgr is None:
            self._fw_writer_for_saves()
            mgr = CheckpointManager(run_dir, writer=self._fw_writer, name=f"{PREFIX_CHECKPOINT_DIR}-{{step}}",
                                    allow_pickle=self._fw_allow_pickle,
                                    on_commit=lambda step, path: self._fw_committed(run_dir, path))
            self._fw_managers[run_dir] = mgr
        return mgr

    def _fw_committed(self, run_dir: str, path: str) -> None:
        """After each commit, on the commit thread: the Trainer's own rotation."""
        mgr = self._fw_managers.get(run_dir)
        pending = mgr.in_flight() if mgr is not None else None
        if pending is not None and pending[1] == path:
            self.flashwrite_stats.append(pending[2].result())
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _fw_state(self) -> dict:
        """What the Trainer's torch.save calls would write, as one state dict."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        state: dict[str, Any] = {MODEL_KEY: model.state_dict()}
        if not self.args.save_only_model:
            if self.optimizer is not None:
                state["optimizer"] = self.optimizer.state_dict()
            if self.lr_scheduler is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch's "please also save the optimizer" warning
                    state["scheduler"] = self.lr_scheduler.state_dict()
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler.state_dict()
            state["rng"] = _rng_states()
        return state

    def _fw_small_files(self, model: Any) -> dict[str, bytes]:
        """config.json, generation_config.json, trainer_state.json, training_args.bin and the
        tokenizer's files, written by their own code (as ``save_pretrained`` and the Trainer
        call it) into a scratch directory and read back."""
        with tempfile.TemporaryDirectory(prefix="flashwrite-trainer-") as scratch:
            if isinstance(model, PreTrainedModel):
                model.config.dtype = str(model.dtype).split(".")[1]
                model.config.architectures = [model.__class__.__name__]
                if model.is_remote_code():
                    from transformers.dynamic_module_utils import custom_object_save
                    custom_object_save(model, scratch, config=model.config)
                model.config.save_pretrained(scratch)
                if model.can_generate() and model.generation_config is not None:
                    model.generation_config.save_pretrained(scratch)
            tokenizer = self.processing_class
            if tokenizer is None and getattr(self.data_collator, "tokenizer", None) is not None:
                tokenizer = self.data_collator.tokenizer
            if tokenizer is not None:
                tokenizer.save_pretrained(scratch)
            torch.save(self.args, os.path.join(scratch, TRAINING_ARGS_NAME))
            self.state.save_to_json(os.path.join(scratch, TRAINER_STATE_NAME))
            files = {}
            for e in os.scandir(scratch):
                if e.is_dir(follow_symlinks=False):
                    raise NotImplementedError(f"flashwrite.transformers: {e.name}/ written by save_pretrained is a "
                                              "directory; only flat files are committed with a checkpoint")
                with open(e.path, "rb") as fh:
                    files[e.name] = fh.read()
            return files

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        reason = self._fw_unsupported()
        if reason is not None:
            if not self._fw_warned:
                log.warning("flashwrite.transformers: %s is not supported; using the Trainer's own checkpoints", reason)
                self._fw_warned = True
            return super()._save_checkpoint(model, trial)
        # As Trainer._save_checkpoint does, in its order, but the files go into one commit.
        step = self.state.global_step
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        mgr = self._fw_manager(run_dir)
        self._fw_record_best(run_dir)
        if self.args.should_save:
            for cb in [cb for cb in self.callback_handler.callbacks + [self.control]
                       if isinstance(cb, ExportableState)]:
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
        if not self.args.should_save:
            return
        files = self._fw_small_files(self.accelerator.unwrap_model(self.model, keep_torch_compile=False))
        state = self._fw_state()
        fits = _hf_layout_fits(state)
        if not fits and not self._fw_warned_layout:
            self._fw_warned_layout = True
            log.warning("flashwrite.transformers: the model's tensors cannot be stored under their own names (none, "
                        "or names that clash with the rest of the state): model.safetensors.index.json names the "
                        "whole training state, and the Trainer's own loaders cannot read the model from it")
        # Waits for the save in flight (if any) to commit, then returns once this one is staged.
        mgr.save(step, state, overwrite=True, hf_model=MODEL_KEY if fits else None,
                 extra_files=files)
        if self.args.push_to_hub:
            mgr.wait()
            self._push_from_checkpoint(output_dir)

    def _fw_record_best(self, run_dir: str) -> None:
        """``best_model_checkpoint``, as the Trainer sets it right after ``save_model``: the
        best step's directory if it exists by then, which the checkpoint of this very step
        does for the Trainer. Here that one is not on disk yet (it is being staged), and it
        counts too; if its save fails, the next wait raises that. A best checkpoint is so
        recorded by its own save, in flight or not when the next one starts."""
        if (self.args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST]
                and self.state.best_global_step):
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if (self.state.best_global_step == self.state.global_step and self.args.should_save) \
                    or os.path.exists(best_dir):
                self.state.best_model_checkpoint = best_dir

    def reserve_checkpoint_memory(self) -> None:
        """Size flashwrite's staging pool for this Trainer's state now, in the background
        (``Writer.reserve``), unless it is sized already or the Trainer's checkpoints do not
        go through flashwrite (the callback that calls it runs after the first step)."""
        if self._fw_unsupported() is not None:
            return
        writer = self._fw_writer_for_saves()
        if writer.pool_bytes == 0:
            writer.reserve(self._fw_state())

    def close_checkpoints(self) -> None:
        """Wait for every checkpoint save in flight and close the managers; a save that
        failed is logged and reported on stderr, not raised (what interpreter exit runs)."""
        for run_dir, mgr in list(self._fw_managers.items()):
            try:
                mgr.close()
            except Exception as e:
                log.error("flashwrite.transformers: a checkpoint under %s failed: %s", run_dir, e)
                print(f"flashwrite: a Trainer checkpoint under {run_dir} failed and was never committed: {e}",
                      file=sys.stderr)

    def wait_for_checkpoints(self) -> None:
        """Block until every checkpoint save in flight has committed (and rotation has
        run); raises the error of a save that failed."""
        for mgr in list(self._fw_managers.values()):
            mgr.wait()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = super().train(*args, **kwargs)
        except BaseException:
            self._fw_resume = None
            try:
                self.wait_for_checkpoints()
            except Exception as e:  # do not hide the error already on its way
                log.error("flashwrite.transformers: a checkpoint failed: %s", e)
            raise
        self._fw_resume = None
        self.wait_for_checkpoints()
        return out

    def _finalize_training(self, trial: Any, num_train_samples: Any, start_time: Any) -> Any:
        # Before the best model is loaded and the save_total_limit=1 clean-up lists the
        # checkpoints: a save still in flight would commit after that clean-up.
        self.wait_for_checkpoints()
        return super()._finalize_training(trial, num_train_samples, start_time)

    def _load_best_model(self) -> None:
        self.wait_for_checkpoints()
        best = self.state.best_model_checkpoint
        if not is_flashwrite_checkpoint(best):
            return super()._load_best_model()
        # As resume does, not the Trainer's way: every byte verified, a strict load, and
        # the model found also where the index names the whole state (_hf_layout_fits).
        log.info("loading the best model from flashwrite checkpoint %s (score: %s)", best, self.state.best_metric)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        state = load(best, map_location="cpu", allow_pickle=self._fw_allow_pickle)
        model.load_state_dict(state[MODEL_KEY])

    # ---------------------------------------------------------------- resuming

    def _fw_resumed(self, checkpoint: str) -> dict:
        """The state of ``checkpoint``, read once per resume."""
        path = os.path.abspath(checkpoint)
        if self._fw_resume is None or self._fw_resume[0] != path:
            self._fw_resume = (path, load(path, map_location="cpu", allow_pickle=self._fw_allow_pickle))
        return self._fw_resume[1]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not is_flashwrite_checkpoint(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = self.model if model is None else model
        state = self._fw_resumed(resume_from_checkpoint)
        log.info("loading the model from flashwrite checkpoint %s", resume_from_checkpoint)
        model.load_state_dict(state.pop(MODEL_KEY))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not is_flashwrite_checkpoint(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = self._fw_resumed(checkpoint)
        if "optimizer" not in state or "scheduler" not in state:
            log.warning("flashwrite checkpoint %s holds no optimizer/scheduler state (saved with "
                        "save_only_model=True?): they start afresh", checkpoint)
            return
        self.optimizer.load_state_dict(state["optimizer"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not is_flashwrite_checkpoint(checkpoint):
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        saved = self._fw_resumed(checkpoint).get("scaler")
        if scaler is not None and saved is not None:
            scaler.load_state_dict(saved)
        elif scaler is not None:
            log.warning("flashwrite checkpoint %s holds no gradient scaler state: it starts afresh", checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not is_flashwrite_checkpoint(checkpoint):
            return super()._load_rng_state(checkpoint)
        rng = self._fw_resumed(checkpoint).get("rng")
        if rng is None:
            log.warning("flashwrite checkpoint %s holds no RNG states: reproducibility is not guaranteed", checkpoint)
            return
        _set_rng_states(rng)
        self._fw_resume = None  # the last of the loaders the Trainer calls on resume


class _ReservePool(transformers.TrainerCallback):
    """After the first optimizer step (when AdamW's state exists), size the staging pool for
    the state in the background (``Writer.reserve``), so the first checkpoint stalls the
    loop no longer than later ones instead of allocating and faulting in the pool."""

    def __init__(self, trainer: FlashwriteTrainerMixin):
        self._trainer = weakref.ref(trainer)
        self._done = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if self._done or trainer is None or control.should_save or not args.should_save:
            return  # a save due now sizes the pool itself
        self._done = True
        if args.save_strategy != SaveStrategy.NO:
            trainer.reserve_checkpoint_memory()


def _hf_layout_fits(state: dict) -> bool:
    """Whether the model's tensors can go under their own names into the stripes that
    model.safetensors.index.json lists (``hf_model=``), as the Trainer's model.safetensors
    holds them, for any model: not when it has no tensors, or a name that could be the
    name of a tensor elsewhere in the state (then the index names the whole state)."""
    model = state[MODEL_KEY]
    heads = {k.split(".", 1)[0] for k in model if isinstance(k, str)}
    return (any(isinstance(v, torch.Tensor) for v in model.values()) and all(isinstance(k, str) for k in model)
            and not heads & (set(state) - {MODEL_KEY}))


def _rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state()
    return states


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


def _set_rng_states(states: dict) -> None:
    random.setstate(_tuples(states["python"]))
    np.random.set_state(tuple(states["numpy"]))
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.random.set_rng_state(states["cuda"])


class FlashwriteTrainer(FlashwriteTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go through flashwrite (see the module docstring)."""


def with_flashwrite(trainer_cls: type) -> type:
    """A subclass of ``trainer_cls`` (a ``Trainer`` subclass) with flashwrite checkpoints."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"with_flashwrite needs a transformers.Trainer subclass, not {trainer_cls!r}")
    if issubclass(trainer_cls, FlashwriteTrainerMixin):
        return trainer_cls
    return type(f"Flashwrite{trainer_cls.__name__}", (FlashwriteTrainerMixin, trainer_cls),
                {"__module__": trainer_cls.__module__, "__doc__": trainer_cls.__doc__})


# Saves in flight at interpreter exit: the commit thread is joined before atexit functions run
# (so the save completes); this reports one that failed and was never waited for.
_LIVE: weakref.WeakSet = weakref.WeakSet()
_exit_lock = threading.Lock()


@atexit.register
def _report_at_exit() -> None:
    with _exit_lock:
        for trainer in list(_LIVE):
            trainer.close_checkpoints()
