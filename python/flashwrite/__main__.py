"""``python -m flashwrite``: the ``flashwrite`` command, for environments whose scripts
directory is not on PATH."""

import sys

from .ops.main import main

sys.exit(main())
