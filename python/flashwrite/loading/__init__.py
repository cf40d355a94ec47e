"""A load, from a checkpoint to tensors: ``load.py`` (``load``, ``load_async``, ``verify``), ``read.py``
(the native parallel read, verified, placed), ``read_plan.py`` (what to read where), ``foreign.py``
(safetensors files flashwrite did not write); the nested state comes back through ``state/``. May
import: ``targets``, ``state``, ``format``, ``system``, the face and ``_core``; never ``saving``
(a load with ``process_group=`` is ``load.load_rank``, which needs no collective)."""
