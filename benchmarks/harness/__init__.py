"""The benchmark harness behind ``benchmarks/compare.py`` and ``benchmarks/overhead.py``
(until issue 36, ``flashwrite bench`` / ``flashwrite overhead``, shipped in the wheel).

peers: one class per contender; measure: CPU and memory accounting, and the fresh
process each contender runs in; runner: the side-by-side comparison; overhead: the
training-overhead benchmark; report: table, JSON and PNG. The synthetic state, the
device-limit probe and the table drawing are the package's (``flashwrite.ops.synthetic``,
``.devicelimit``, ``.demo``): ``flashwrite demo`` and ``flashwrite tune`` use them too.
"""
