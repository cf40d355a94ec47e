"""Training checkpoints that are also Hugging Face models (``save_async(..., hf_model="model")``).

The tensors of the subtree ``state[hf_model]`` (a ``model.state_dict()``) are stored
under their own names (``model.layers.0.mlp.up_proj.weight``, not
``model.model.layers...``) in the stripes that ``model.safetensors.index.json``
lists; the rest of the state (optimizer, step, RNG) goes into ``state-*`` stripes
that the index does not list. Tied weights are stored once, as ``save_pretrained``
does. ``from_pretrained(path)`` then sees a sharded model (plus ``config.json`` from
``hf_config``), and ``flashwrite.load(path)`` still returns the whole state.
"""

from __future__ import annotations

import json
from typing import Any

from ..format.tree import tensor_nodes
from ..state.flatten import FlatTensor

MODEL_PREFIX = "model"   # stripe names of the group the index lists (what from_pretrained reads)
STATE_PREFIX = "state"   # stripe names of the rest of the state
CONFIG_NAME = "config.json"
# Why an incremental save with hf_model= writes every stripe (SaveStats.incremental).
NOT_INCREMENTAL = "off: hf_model= saves are not incremental yet (the save writes every stripe)"


def split(state: Any, tree: dict, tensors: list[FlatTensor], aliases: dict[str, str],
          hf_model: str) -> tuple[list[FlatTensor], list[FlatTensor]]:
    """(model tensors, other tensors); renames the model's keys to their names inside
    ``state[hf_model]``, in ``tensors``, ``aliases`` and the tree (in place)."""
    if not isinstance(state, dict) or not isinstance(state.get(hf_model), dict):
        raise ValueError(f"hf_model={hf_model!r}: state[{hf_model!r}] must be a model's state_dict() (a dict)")
    prefix = f"{hf_model}."
    rename = {ft.key: ft.key[len(prefix):] for ft in tensors if ft.key.startswith(prefix)}
    rename.update((k, k[len(prefix):]) for k in aliases if k.startswith(prefix))
    if not rename:
        raise ValueError(f"hf_model={hf_model!r}: state[{hf_model!r}] holds no tensors")
    others = {ft.key for ft in tensors if ft.key not in rename}
    clash = sorted(set(rename.values()) & others)
    if clash:
        raise ValueError(f"hf_model={hf_model!r}: the model's tensor {clash[0]!r} has the same name as a tensor "
                         "elsewhere in the state; rename that entry")
    for ft in tensors:
        ft.key = rename.get(ft.key, ft.key)
    for k, canon in list(aliases.items()):
        del aliases[k]
        aliases[rename.get(k, k)] = rename.get(canon, canon)
    for node in tensor_nodes(tree):
        node["k"] = rename.get(node["k"], node["k"])
    return [ft for ft in tensors if ft.key not in others], [ft for ft in tensors if ft.key in others]


def config_bytes(config: Any) -> bytes:
    """config.json of a ``PretrainedConfig`` (its own serialisation) or a plain dict."""
    if hasattr(config, "to_json_string"):
        return config.to_json_string(use_diff=False).encode()
    if isinstance(config, dict):
        return json.dumps(config, indent=2, sort_keys=True).encode()
    raise TypeError(f"hf_config must be a transformers PretrainedConfig or a dict, not {type(config).__qualname__}")
