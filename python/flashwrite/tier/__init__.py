"""The node-local tier: ``node.py`` (one Writer's pool file, snapshots and neighbour copies), ``snapshot.py``
(the snapshot format in /dev/shm and reading one back), ``neighbour.py`` (a copy of rank r-1's snapshot),
``restore.py`` (the newest step that verifies, from memory or storage). May import: ``loading``, ``format``,
``system``, the face and ``_core``."""
