"""A/B cold loads of one checkpoint by two flashwrite builds, alternating, each in a fresh
process with the page cache dropped before it (root): medians and every round.

    python tools/ab_cold_load.py CHECKPOINT BEFORE_PYTHON AFTER_PYTHON [ROUNDS]

Each python is an interpreter whose flashwrite is the build to measure (a venv with an
editable install of a worktree at that commit). Every page of the loaded state is read
inside the clock."""
import subprocess, sys, time, os, statistics
ck = sys.argv[1]
pys = {"before": sys.argv[2], "after": sys.argv[3]}
code = ("import time, flashwrite as fw\nt0=time.perf_counter()\ns=fw.load(%r)\nn=0\n"
        "for t in s.values(): n += t.sum().item() != 0\nprint(time.perf_counter()-t0)") % ck
res = {k: [] for k in pys}
for r in range(int(sys.argv[4]) if len(sys.argv) > 4 else 6):
    for k, py in pys.items():
        subprocess.run(["sync"]); open("/proc/sys/vm/drop_caches", "w").write("3\n")
        out = subprocess.run([py, "-c", code], capture_output=True, text=True)
        res[k].append(float(out.stdout.strip().splitlines()[-1]))
print({k: (round(statistics.median(v), 3), [round(x, 3) for x in v]) for k, v in res.items()})
