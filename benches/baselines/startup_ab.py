#!/usr/bin/env python3
"""A/B of launch time: `lockstep launch --nproc-per-node N -- BIN selftest` for N = 2 and 8,
the binaries alternating within each round, so that both see the same machine state.

Usage: benches/baselines/startup_ab.py ROUNDS RUNS BIN [BIN ...]
       benches/baselines/startup_ab.py --once RUNS CMD [ARG ...]

Each cell is RUNS launches after 3 warm-ups, started with posix_spawn; it reports the median
wall time and the median CPU time (user + system of the launcher and every process it waited
for, from wait4). Prints each round, then per binary and N the median of the round medians, the
fastest round, and the median CPU time. Every launch must exit 0.

`--once` times one command the same way and prints "median p90 cpu" in ms, or "failed" when it
could not start or exited non-zero (startup.sh's measurement).
"""
import os
import statistics
import sys
import time


WARMUPS = 3


def times(argv, runs, null):
    """Wall and CPU times in ms of RUNS runs of argv after the warm-ups; None if a run could not
    start or exited non-zero."""
    wall, cpu = [], []
    for i in range(runs + WARMUPS):
        t0 = time.perf_counter()
        try:
            pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=[(os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, null, 2)])
        except OSError:
            return None
        _, st, ru = os.wait4(pid, 0)
        t1 = time.perf_counter()
        if st != 0:
            return None
        if i >= WARMUPS:
            wall.append((t1 - t0) * 1e3)
            cpu.append((ru.ru_utime + ru.ru_stime) * 1e3)
    return wall, cpu


def measure(argv, runs, null):
    t = times(argv, runs, null)
    if t is None:
        sys.exit(f"{' '.join(argv)}: could not start, or exited non-zero")
    return statistics.median(t[0]), statistics.median(t[1])


def once(runs, argv):
    t = times(argv, runs, os.open("/dev/null", os.O_WRONLY))
    if t is None:
        print("failed")
        return
    wall = sorted(t[0])
    p90 = wall[min(len(wall) - 1, round(0.9 * len(wall)) - 1)]
    print("%.1f %.1f %.1f" % (statistics.median(wall), p90, statistics.median(t[1])))


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "--once":
        return once(int(sys.argv[2]), sys.argv[3:])
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
