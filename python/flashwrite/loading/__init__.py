"""A load, from a checkpoint to tensors: ``load.py`` (``load``, ``load_async``, ``verify``), ``read.py``
(the native parallel read, verified, placed), ``read_plan.py`` (what to read where), ``rebuild.py`` (the
nested state back), ``foreign.py`` (safetensors files flashwrite did not write). May import: ``targets``,
``saving.flatten`` (the tree format), ``format``, ``system``, the face and ``_core``."""
