"""A synthetic training state (``flashwrite demo``, and the benchmarks of the repository's
``benchmarks/``): transformer-like parameters, Adam moments and the
non-tensor fields a real optimizer and trainer carry (hyper-parameters, step
counters, RNG state, config strings).

The bytes are pseudo-random (copied from one random block), so nothing on the
data path can shortcut them (zero pages, compression), and filling 2 GiB costs
about one memcpy instead of seconds of random number generation.
"""

from __future__ import annotations

import math

import torch

def _layer_shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("attn_norm.weight", (d,)), ("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
            ("attn.out.weight", (d, d)), ("mlp_norm.weight", (d,)), ("mlp.up.weight", (4 * d, d)),
            ("mlp.up.bias", (4 * d,)), ("mlp.down.weight", (d, 4 * d))]


def _model_shapes(param_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Shapes of a GPT-like model whose float32 parameters take about param_bytes."""
    per_layer_at = lambda d: 4 * sum(math.prod(s) for _, s in _layer_shapes(d))  # noqa: E731
    layers, d = 4, 64
    # Wider first (1024 is a realistic width), then deeper.
    while d < 1024 and per_layer_at(d * 2) * layers + 4 * 8192 * d * 2 <= param_bytes:
        d *= 2
    layers = max(1, int((param_bytes - 4 * 8192 * d) // per_layer_at(d)))
    # The embedding takes up the remainder, so the total lands close to what was asked.
    vocab = max(1024, int((param_bytes - layers * per_layer_at(d) - 4 * d) // (4 * d)))
    shapes = [("embed.weight", (vocab, d))]
    for i in range(layers):
        shapes += [(f"layers.{i}.{n}", s) for n, s in _layer_shapes(d)]
    shapes.append(("final_norm.weight", (d,)))
    return shapes


def make_state(total_bytes: int, seed: int = 0) -> dict:
    """A nested training state of about total_bytes: {"model", "optim", "step", ...}.

    One third is parameters, two thirds Adam's exp_avg / exp_avg_sq, as in mixed
    nothing-fancy float32 training. The optimizer part has the layout of
    ``torch.optim.Adam.state_dict()`` (int keys, tuples, None and bool fields).
    """
    shapes = _model_shapes(max(total_bytes // 3, 1 << 16))
    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(4 << 20, generator=gen)  # 16 MiB of randomness, reused at shifting offsets
    cursor = [0]

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.empty(shape)
        flat, n, done = t.view(-1), t.numel(), 0
        while done < n:
            start = cursor[0] % (block.numel() - 1)
            take = min(n - done, block.numel() - start)
            flat[done:done + take].copy_(block[start:start + take])
            done += take
            cursor[0] += take + 7919  # shift so tensors don't all start alike
        return t

    model = {name: tensor(shape) for name, shape in shapes}
    state = {}
    for i, (_, shape) in enumerate(shapes):
        state[i] = {"step": torch.tensor(1000.0), "exp_avg": tensor(shape), "exp_avg_sq": tensor(shape).abs_()}
    optim = {"state": state,
             "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
                               "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                               "fused": None, "params": list(range(len(shapes)))}]}
    return {"model": model, "optim": optim, "step": 1000, "epoch": 3, "loss": 2.3125,
            "rng": {"torch": torch.get_rng_state()}, "config": {"name": "synthetic-gpt", "width": shapes[0][1][1],
                                                                 "layers": (len(shapes) - 2) // 8}}


def planned_bytes(total_bytes: int) -> int:
    """The exact tensor bytes make_state(total_bytes) will hold, without allocating them."""
    shapes = _model_shapes(max(total_bytes // 3, 1 << 16))
    params = sum(4 * math.prod(s) for _, s in shapes)
    return 3 * params + 4 * len(shapes) + torch.get_rng_state().numel()


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor in a nested state, in traversal order."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
    return out


def state_bytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(obj))
