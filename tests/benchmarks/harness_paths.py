"""Where the repository's benchmarks/ folder is, put on this process's path so tests
import its harness (``harness.runner``, ...) as benchmarks/compare.py does."""

from __future__ import annotations

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "benchmarks")
COMPARE = os.path.join(BENCHMARKS, "compare.py")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
