"""Where the repository's benchmarks/ folder is, put on this process's path so tests
import its harness (``harness.runner``, ...) and ``compare`` as benchmarks/compare.py
does. Last on the path: its other scripts (incremental.py, nfs.py, ...) must not shadow
what the tests import by those names."""

from __future__ import annotations

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "benchmarks")
COMPARE = os.path.join(BENCHMARKS, "compare.py")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)
