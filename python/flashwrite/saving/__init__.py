"""A save, from a state dict to a committed checkpoint: ``save.py`` (``Writer``, ``save``, ``save_async``),
``session.py`` (one save's life cycle), ``hf.py`` (the Hugging Face model group), ``write.py``
(staging and writing the stripes through the native engine), ``commit.py`` (visible only when whole and
durable), ``distributed.py`` (multi-rank saves); the stripe plan is ``layout``'s. May import:
``targets``, ``incremental``, ``layout``, ``state``, ``tier``, ``format``, ``system``, the face (``errors``, ``future``, ``defaults``) and ``_core``."""
