"""The GPU incremental check of gpu_check.py: a LoRA-shaped state on the GPU (frozen bf16
base, trainable adapters) saved four times with ``Writer(incremental=True)`` while the
adapters change. From the second save on, the previous checkpoint's stripes are held
files (staged from the GPU, checksummed, then hard-linked instead of written:
csrc/write/save_held.cpp); a held stripe that mixed adapters and base is written, and
the next save plans the base tensors into stripes of their own, so from the last or
fourth save on the whole frozen base is linked. The last save must link it all, load
back byte-exact to the GPU and pass ``verify``. Not run on a machine without a GPU.
"""

from __future__ import annotations

import os
import time


def incremental_check(dev, base: str, gib: float = 1.0) -> dict:
    import torch

    import flashwrite as fw
    g = torch.Generator(device=dev).manual_seed(1)
    rows = max(1, int(gib * (1 << 30)) // 2 // 8 // 4096)
    frozen = {f"base.{i}": torch.randn(rows, 4096, device=dev, generator=g).bfloat16() for i in range(8)}
    adapters = {f"lora.{i}": torch.randn(4096, 16, device=dev, generator=g) for i in range(8)}
    state = {"model": {**frozen, **adapters}, "step": 0}
    root = os.path.join(base, "incremental")
    os.makedirs(root, exist_ok=True)
    out: dict = {"frozen_bytes": sum(t.numel() * t.element_size() for t in frozen.values()), "saves": []}
    with fw.Writer(stripes=4, incremental=True) as w:
        for step in range(4):
            for t in adapters.values():
                t.add_(1.0)
            state["step"] = step
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fut = w.save_async(state, os.path.join(root, f"step-{step}"))
            stall = time.perf_counter() - t0
            fut.result()
            s = fut.stats
            out["saves"].append({"stall_s": stall, "durable_s": s.durable_s, "bytes": s.bytes,
                                 "bytes_written": s.bytes_written, "bytes_linked": s.bytes_linked,
                                 "stripes_linked": s.stripes_linked, "link_fallbacks": s.link_fallbacks,
                                 "incremental": s.incremental})
    last = out["saves"][-1]
    final = os.path.join(root, "step-3")
    back = fw.load(final, map_location=str(dev))
    torch.cuda.synchronize(dev)
    exact = back["step"] == 3 and all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    fw.verify(final)
    out["roundtrip_ok"] = bool(exact)
    out["ok"] = bool(exact and last["incremental"] == "on" and last["stripes_linked"] >= 1
                     and last["bytes_linked"] >= out["frozen_bytes"] and last["link_fallbacks"] == 0)
    return out
