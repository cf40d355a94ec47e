"""What the process and the machine offer: ``cuda.py`` (the GPU seen from Python: streams, devices,
capture checks), ``owner.py`` (which process wrote something and whether it runs), ``gcpause.py``, ``sizes.py``
(byte sizes for people), ``info.py`` (``backend_info``), ``coord.py`` (flashwrite's own gloo group for multi-rank agreement), ``sigint.py`` (the steps a Ctrl-C must not break). May import only ``errors``, ``defaults`` and ``_core``."""
