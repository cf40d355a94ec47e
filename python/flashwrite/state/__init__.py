"""A state dict and its tree: ``flatten.py`` (a nested state to (tree, tensors) on save, keeping sharing,
views and Parameters) and ``rebuild.py`` (the tree back to the nested state on load, read as hostile
input). Saving, loading, incremental saves and the tier use it. May import ``format``, ``system``,
``errors`` and ``_core``."""
