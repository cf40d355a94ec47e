"""Where checkpoints live: the targets. ``target.py`` (``Target``, ``LocalTarget``, and the one place
that tells a URL from a path), ``locate.py`` (which target a user's path names, resolved once: ``Located``), ``nfs.py`` (``nfs://`` on the
native NFSv3 client), ``tuning.py`` (saved tunings of a file system). May import: ``format``, ``system``,
``errors``, ``defaults``, ``_core``."""
