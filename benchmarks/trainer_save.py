"""Training-loop time the Hugging Face Trainer spends saving, per checkpoint: its own
checkpoints (save_pretrained + torch.save of optimizer/scheduler/RNG) against
flashwrite.transformers' (staged, then written and committed while training goes on).

One invocation runs both, each in a fresh process, on the same model (GPT-2 shaped,
~124M parameters: ~500 MB of fp32 weights, plus ~1 GB of AdamW state), saving every
``--save-steps`` steps with ``save_total_limit=2``:

    python benchmarks/trainer_save.py --dir /tmp/trainer-bench --steps 8 --save-steps 2 \
        --json benchmarks/results/hf-trainer-save-every-2-steps-2026-12-01.json

With ``--save-steps 1`` the first save also allocates flashwrite's staging pool (there is
no step without a save to reserve it in the background, see ``flashwrite.transformers``).

Per checkpoint it records the wall time of ``Trainer._save_checkpoint`` (what the training
loop waits for), and for flashwrite also the save's stall and its time to durable.
flashwrite's checkpoints are fsync'd when committed; the Trainer's own are not (torch.save
returns once the bytes are in the page cache), so its time is a lower bound of its cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def child(mode: str, out: str, steps: int, save_steps: int, result: str) -> None:
    import torch
    import transformers

    from flashwrite.integrations.transformers import FlashwriteTrainer

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, cfg.vocab_size, (64, 32), generator=g)]
    cls = FlashwriteTrainer if mode == "flashwrite" else transformers.Trainer
    saves: list[float] = []
    steps_t: list[float] = []

    class Timed(cls):
        def _save_checkpoint(self, model, trial):
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            saves.append(time.perf_counter() - t0)

    class StepClock(transformers.TrainerCallback):
        t0 = None

        def on_step_begin(self, *a, **k):
            StepClock.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            steps_t.append(time.perf_counter() - StepClock.t0)

    args = transformers.TrainingArguments(out, max_steps=steps, save_steps=save_steps, save_total_limit=2,
                                          per_device_train_batch_size=1, report_to=[], use_cpu=True,
                                          disable_tqdm=True, logging_steps=1000, optim="adamw_torch")
    trainer = Timed(model=model, args=args, train_dataset=data, callbacks=[StepClock()])
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    ck = os.path.join(out, f"checkpoint-{steps}")
    size = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck))
    doc = {"mode": mode, "params": n_params, "weights_bytes": n_params * 4, "checkpoint_bytes": size,
           "save_s": saves, "step_s_without_save": steps_t, "train_s": total}
    if mode == "flashwrite":
        doc["stall_s"] = [s.stall_s for s in trainer.flashwrite_stats]
        doc["durable_s"] = [s.total_s for s in trainer.flashwrite_stats]
        doc["backend"] = trainer.flashwrite_stats[-1].backend
    with open(result, "w") as fh:
        json.dump(doc, fh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/flashwrite-trainer-bench")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-steps", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "OUT", "RESULT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.steps, a.save_steps, a.child[2])
        return
    runs = {}
    for mode in ("trainer", "flashwrite"):
        out = os.path.join(a.dir, mode)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        res = os.path.join(a.dir, f"{mode}.json")
        subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--save-steps", str(a.save_steps),
                        "--child", mode, out, res], check=True)
        with open(res) as fh:
            runs[mode] = json.load(fh)
        shutil.rmtree(out, ignore_errors=True)
    # The first save of each run allocates (flashwrite: its staging pool); later ones are the steady state.
    table = ["| checkpoints by | checkpoint | first save | later saves, median (min-max) | step without save |",
             "|---|---|---|---|---|"]
    for mode, r in runs.items():
        later = r["save_s"][1:]
        table.append(f"| {mode} | {r['checkpoint_bytes'] / 1e9:.2f} GB | {r['save_s'][0]:.2f} s | "
                     f"{statistics.median(later):.3f} s ({min(later):.3f}-{max(later):.3f}) | "
                     f"{statistics.median(r['step_s_without_save']):.2f} s |")
    fwr = runs["flashwrite"]
    note = (f"flashwrite ({fwr['backend']}): stall median {statistics.median(fwr['stall_s'][1:]):.3f} s, "
            f"durable after median {statistics.median(fwr['durable_s'][1:]):.2f} s")
    print("\n".join(table))
    print(note)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "runs": runs,
                       "table": table, "note": note}, fh, indent=1)


if __name__ == "__main__":
    main()
