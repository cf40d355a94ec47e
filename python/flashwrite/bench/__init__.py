"""Benchmarks behind ``flashwrite bench`` / ``flashwrite demo`` / ``flashwrite overhead``.

state: the synthetic training state; devicelimit: fio / O_DIRECT probe and memcpy
reference lines; peers: one class per contender; measure: CPU and memory
accounting; runner: the side-by-side comparison; overhead: the training-overhead
benchmark; report: table, JSON and PNG.
"""
