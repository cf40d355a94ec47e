"""Where a checkpoint's bytes and names go, shared by everything that writes one:
``plan.py`` (a flattened state to stripe files: which tensors, in which order, under
which names) and ``names.py`` (the names of a checkpoint's temporary and moved-aside
siblings, made and read there only). Saving and incremental saves both plan with it,
so it sits below them. May import ``format``, ``state``, ``system``, the face
(``errors``) and ``_core``."""
