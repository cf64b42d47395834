#!/usr/bin/env python3
"""A/B of launch time: `lockstep launch --nproc-per-node N -- BIN selftest` for N = 2 and 8,
the binaries alternating within each round, so that both see the same machine state.

Usage: benches/baselines/startup_ab.py ROUNDS RUNS BIN [BIN ...]

Each cell is RUNS launches after 2 warm-ups, started with posix_spawn (as startup.sh does); it
reports the median wall time and the median CPU time (user + system of the launcher and every
process it waited for, from wait4). Prints each round, then per binary and N the median of the
round medians, the fastest round, and the median CPU time. Every launch must exit 0.
"""
import os
import statistics
import sys
import time


def measure(argv, runs, null):
    wall, cpu = [], []
    for i in range(runs + 2):
        t0 = time.perf_counter()
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=[(os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, null, 2)])
        _, st, ru = os.wait4(pid, 0)
        t1 = time.perf_counter()
        if st != 0:
            sys.exit(f"{' '.join(argv)}: exit status {st}")
        if i >= 2:
            wall.append((t1 - t0) * 1e3)
            cpu.append((ru.ru_utime + ru.ru_stime) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    rounds, runs, bins = int(sys.argv[1]), int(sys.argv[2]), [os.path.abspath(b) for b in sys.argv[3:]]
    null = os.open("/dev/null", os.O_WRONLY)
    res = {}
    for r in range(rounds):
        line = []
        for n in (2, 8):
            for b in bins:
                w, c = measure([b, "launch", "--nproc-per-node", str(n), "--", b, "selftest"], runs, null)
                res.setdefault((n, b), []).append((w, c))
                line.append("%s n=%d %.1f/%.1f" % (b, n, w, c))
        print("round", r, " | ".join(line), flush=True)
    for (n, b), v in sorted(res.items()):
        ws, cs = sorted(x[0] for x in v), sorted(x[1] for x in v)
        print("n=%d %s: wall %.2f ms (median of rounds; fastest %.2f), cpu %.2f ms" % (n, b, statistics.median(ws), ws[0], statistics.median(cs)))


if __name__ == "__main__":
    main()
