"""The checkpoint manager: ``manager.py`` (``CheckpointManager``: schedule, keep, drain), ``setup.py`` (its
options and the Writer it makes), ``steps.py`` (step directories: names, listing, deletion, crash clean-up),
``preempt.py`` (SIGTERM). May import: ``saving``, ``loading``, ``tier``, ``targets``, ``format``, ``system``,
the face."""
