"""Incremental saves: link what an earlier checkpoint already holds. ``link.py`` (the plan: which stripes
link, which are written), ``wiring.py`` (the incremental save a save path asks for, handed to its
session), ``compare.py`` (the compare pass), ``write_watch.py`` (the kernel's record of written
memory), ``held.py`` (GPU stripes held until their checksums are known). May import: ``targets``, ``layout``, ``state``, ``format``,
``system``, the face and ``_core``; never ``saving`` (which calls it)."""
