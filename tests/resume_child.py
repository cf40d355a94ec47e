"""A small training run that checkpoints with flashwrite and resumes in a fresh process.

python resume_child.py full CKPT N    -> trains 2N steps, saves after step N, prints the losses and final weights
python resume_child.py resume CKPT N  -> loads CKPT (saved after step N), trains steps N+1..2N, prints the same

The README's resume recipe, exercised: model, AdamW, LR scheduler, GradScaler, step, and the
torch, CUDA, numpy and Python RNG states. Each step draws its batch from all three RNGs and
the model has dropout, so any state that is not restored exactly changes the losses.
"""

import json
import random
import sys

import numpy as np
import torch

import flashwrite as fw


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return model, opt, sched, scaler


def train_step(model, opt, sched, scaler):
    x = torch.randn(8, 16) + torch.from_numpy(np.random.rand(8, 16).astype(np.float32)) * random.random()
    y = x.sum(dim=1, keepdim=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    return loss.item()


def checkpoint(model, opt, sched, scaler, step):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
            "scaler": scaler.state_dict(), "step": step,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}}


def restore(state, model, opt, sched, scaler):
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    if state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


def main():
    mode, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    losses = []
    if mode == "full":
        model, opt, sched, scaler = build(0)
        np.random.seed(1)
        random.seed(2)
        for step in range(1, 2 * n + 1):
            losses.append(train_step(model, opt, sched, scaler))
            if step == n:
                fw.save_async(checkpoint(model, opt, sched, scaler, step), path).result()
        losses = losses[n:]
    else:
        model, opt, sched, scaler = build(12345)  # different weights and RNG: everything must come from the file
        np.random.seed(99)
        random.seed(98)
        step = restore(fw.load(path), model, opt, sched, scaler)
        assert step == n
        for step in range(n + 1, 2 * n + 1):
            losses.append(train_step(model, opt, sched, scaler))
    final = {k: v.view(-1).view(torch.int32).tolist() for k, v in model.state_dict().items()}  # the bits
    print(json.dumps({"losses": [float(x).hex() for x in losses], "final": final, "lr": opt.param_groups[0]["lr"],
                      "scale": scaler.get_scale()}))


if __name__ == "__main__":
    main()
