"""lockstep's hierarchical all-reduce against MPICH's own `MPI_Allreduce`, in simulated multi-node
layouts on one host (MPICH's `MPIR_CVAR_NUM_CLIQUES=2`: two "nodes" that talk through its netmod).

For each layout, size and round, back to back: `lockstep bench` under `mpiexec` (LOCKSTEP_MPI=on),
then `mpi_bench.c` in each MPICH arm. Both sides report the same statistic: each rank's mean time
per call over the timed iterations, the slowest rank's (`--stat mean -a 3`; `mpi_bench ... mean`).
MPICH runs in three arms, because where ranks share cores its busy polling decides its speed:
its defaults, yielding after every poll (`MPIR_CVAR_POLLS_BEFORE_YIELD=1`), and that with
nanosleep (`MPIR_CVAR_ENABLE_HEAVY_YIELD=1`). A figure is the median over rounds; "best MPICH" is
the median over rounds of each round's fastest arm, and the ratio is against it. `--before BIN` adds an arm of another lockstep build (a
change's A/B in the same run).

    mpicc -O2 -o /tmp/mpich_bench benches/baselines/mpi_bench.c
    PATH=MPICH/bin:$PATH python3 benches/baselines/hier_ab.py target/release/lockstep /tmp/mpich_bench \
        --layouts 2x1,2x2 --rounds 3
"""
import argparse, json, os, statistics, subprocess, sys

SIZES = {8: 2000, 64 << 10: 1000, 1 << 20: 200, 16 << 20: 30}
MPICH_ARMS = [
    ("MPICH", {}),
    ("MPICH yield", {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}),
    ("MPICH sleep", {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}),
]


def run(cmd, env_extra, timeout):
    env = dict(os.environ, MPIR_CVAR_NUM_CLIQUES="2", **env_extra)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


def lockstep(exe, ranks, size, iters):
    out = run(["mpiexec", "-n", str(ranks), exe, "bench", "--sizes", str(size), "--stat", "mean", "-a", "3",
               "-n", str(iters), "-w", "5", "--format", "json"], {"LOCKSTEP_MPI": "on"}, 600)
    doc = json.loads(out.strip().splitlines()[-1])
    (row,) = doc["rows"]
    if row["out_of_place"].get("wrong", 0):
        raise SystemExit(f"lockstep bench found wrong elements at {size} B")
    return row["out_of_place"]["time_us"]


def mpich(exe, ranks, size, iters, env):
    out = run(["mpiexec", "-n", str(ranks), exe, "all_reduce", str(size), "mean", str(iters)], env, 600)
    # Columns: size count type redop time algbw busbw #wrong p99.
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == str(size):
            if f[7] != "0":
                raise SystemExit(f"mpi_bench found {f[7]} wrong elements at {size} B")
            return float(f[4])
    raise SystemExit(f"no row for {size} B in mpi_bench's output:\n{out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lockstep")
    ap.add_argument("mpi_bench")
    ap.add_argument("--before", help="another lockstep binary, timed as an arm of its own")
    ap.add_argument("--layouts", default="2x1,2x2", help="NODESxRANKS, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", help="SIZE:ITERS pairs, comma-separated (default: " +
                    ",".join(f"{s}:{n}" for s, n in SIZES.items()) + ")")
    a = ap.parse_args()
    sizes = dict((int(x), int(y)) for x, y in (p.split(":") for p in a.sizes.split(","))) if a.sizes else SIZES
    samples = {}
    for layout in a.layouts.split(","):
        nodes, per = (int(x) for x in layout.split("x"))
        ranks = nodes * per
        for _ in range(a.rounds):
            for size, iters in sizes.items():
                key = (layout, size)
                s = samples.setdefault(key, {})
                if a.before:
                    s.setdefault("before", []).append(lockstep(a.before, ranks, size, iters))
                s.setdefault("lockstep", []).append(lockstep(a.lockstep, ranks, size, iters))
                for name, env in MPICH_ARMS:
                    s.setdefault(name, []).append(mpich(a.mpi_bench, ranks, size, iters, env))
                # Progress, so that an interrupted run keeps what it measured.
                print(json.dumps({"layout": layout, "size": size, **{k: v[-1] for k, v in s.items()}}),
                      file=sys.stderr, flush=True)
    arms = (["before"] if a.before else []) + ["lockstep"] + [n for n, _ in MPICH_ARMS]
    print("| layout | size | " + " | ".join(f"{n} (mean µs)" for n in arms) + " | best MPICH | best MPICH / lockstep |")
    print("|---" * (len(arms) + 4) + "|")
    for (layout, size), s in samples.items():
        med = {n: statistics.median(s[n]) for n in arms}
        # MPICH at its best: the fastest arm of each round (arms run back to back), median over
        # rounds; a round where one arm stalls does not decide the figure.
        best = statistics.median(min(s[n][i] for n, _ in MPICH_ARMS) for i in range(len(s["lockstep"])))
        cells = " | ".join(f"{med[n]:.1f}" for n in arms)
        print(f"| {layout} | {size} B | {cells} | {best:.1f} | {best / med['lockstep']:.2f} |")
    if a.before:
        for (layout, size), s in samples.items():
            r = statistics.median(s["lockstep"]) / statistics.median(s["before"])
            print(f"{layout} {size} B: lockstep / before {r:.3f}")
    print(json.dumps({f"{l} {sz}": v for (l, sz), v in samples.items()}))


if __name__ == "__main__":
    main()
