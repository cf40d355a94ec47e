"""A trained model's checkpoint state for the compression benchmark (issue 38 item 4).

Trains a small GPT-2-style model (transformers' GPT2LMHeadModel from a config: no
download) on the CPU for --seconds, on byte-level text (this repository's own sources,
vocabulary 256), with AdamW; then keeps what a training checkpoint holds: bf16
weights, the fp32 master weights, and AdamW's exp_avg and exp_avg_sq. Cached as one
torch.save file (default /tmp/flashwrite-trained-state.pt, outside git: ~0.4 GiB).

    nice -n 19 python benchmarks/trained_state.py --seconds 150 [--out PATH]
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import torch

DEFAULT_OUT = "/tmp/flashwrite-trained-state.pt"


def corpus() -> torch.Tensor:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    data = b"".join(open(p, "rb").read() for p in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def train(seconds: float, layers: int, width: int, seq: int, batch: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=seq, n_embd=width, n_layer=layers, n_head=width // 64)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    text = corpus()
    t0, step, loss = time.time(), 0, float("nan")
    while time.time() - t0 < seconds:
        ix = torch.randint(0, len(text) - seq - 1, (batch,))
        x = torch.stack([text[i:i + seq] for i in ix])
        out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        step, loss = step + 1, out.loss.item()
        if step % 10 == 0:
            print(f"step {step} loss {loss:.3f} ({time.time() - t0:.0f} s)", flush=True)
    master = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    names = {id(p): n for n, p in model.named_parameters()}
    st = opt.state_dict()["state"]
    params = list(model.parameters())
    exp_avg = {names[id(params[i])]: s["exp_avg"] for i, s in st.items()}
    exp_avg_sq = {names[id(params[i])]: s["exp_avg_sq"] for i, s in st.items()}
    return {"weights_bf16": {k: v.to(torch.bfloat16) for k, v in master.items()}, "master_fp32": master,
            "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
            "meta": {"steps": step, "loss": loss, "layers": layers, "width": width, "seconds": seconds}}


def load_or_train(path: str = DEFAULT_OUT, **kw) -> dict:
    if os.path.exists(path):
        return torch.load(path, weights_only=True)
    state = train(**kw)
    torch.save(state, path)
    return state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=DEFAULT_OUT)
    a = ap.parse_args()
    state = train(a.seconds, a.layers, a.width, a.seq, a.batch)
    torch.save(state, a.out)
    n = sum(t.numel() * t.element_size() for part in ("weights_bf16", "master_fp32", "exp_avg", "exp_avg_sq")
            for t in state[part].values())
    print(f"{a.out}: {n / 2**30:.2f} GiB, {state['meta']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
