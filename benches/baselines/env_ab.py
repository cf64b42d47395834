"""One lockstep build in several arms that differ only in environment variables (a feature on and
off: the flight recorder, `LOCKSTEP_TRACE_BUFFER=0`; the finite check, `LOCKSTEP_CHECK_FINITE=1`),
`lockstep bench` all_reduce on 2 forked ranks, every arm once per round with the order turned by
one each round, so the arms see the same machine. A cell is the median over rounds of the arm's
time (each rank's median per call, averaged over the ranks); a ratio is the median over rounds of
the arm's time over the first arm's **in the same round**: this machine's speed drifts more
between rounds than the differences measured here.

    python3 benches/baselines/env_ab.py target/release/lockstep \\
        --arm off:LOCKSTEP_TRACE_BUFFER=0 --arm on: --sizes 8,1M --rounds 21
    python3 benches/baselines/env_ab.py target/release/lockstep \\
        --arm off:LOCKSTEP_CHECK_FINITE=0 --arm on:LOCKSTEP_CHECK_FINITE=1 --buffers ordinary,shared

An arm is NAME:VAR=VALUE[,VAR=VALUE...] (nothing after the colon: the environment as it is).
Prints a table, then one JSON line with every round's figures.
"""
import argparse
import json
import os
import statistics
import subprocess


def arm(spec):
    name, _, env = spec.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"an arm needs a name before the colon: {spec!r}")
    pairs = {}
    for kv in filter(None, env.split(",")):
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise argparse.ArgumentTypeError(f"{kv!r} in arm {name!r} is not VAR=VALUE")
        pairs[k] = v
    return name, pairs


def bench(exe, env, sizes, buffers, op, warmup):
    out = subprocess.run(
        [exe, "bench", "--nprocs", "2", "--op", "all_reduce", "--sizes", sizes, "--buffers", buffers,
         "-o", op, "--format", "json", "-w", str(warmup), "--stat", "median"],
        check=True, capture_output=True, text=True, env=dict(os.environ, **env)).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    got = {}
    for r in doc["rows"]:
        for form in ("out_of_place", "in_place"):
            t = r.get(form)
            if t and t.get("time_us") is not None:
                got[f"{r['size_bytes']} B {form.replace('_', ' ')}"] = t["time_us"]
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lockstep")
    ap.add_argument("--arm", type=arm, action="append", required=True, help="NAME:VAR=VALUE,... (the first is the baseline)")
    ap.add_argument("--sizes", default="8,1M")
    ap.add_argument("--buffers", default="ordinary", help="comma-separated: ordinary,shared")
    ap.add_argument("--op", default="avg", help="reduction (avg keeps in-place sums finite, which LOCKSTEP_CHECK_FINITE=1 needs)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    if len(a.arm) < 2:
        ap.error("give at least two --arm")
    figures = {}  # (buffers, row) -> arm -> [per round]
    for r in range(a.rounds):
        k = r % len(a.arm)
        for name, env in a.arm[k:] + a.arm[:k]:
            for buffers in a.buffers.split(","):
                for row, t in bench(a.lockstep, env, a.sizes, buffers, a.op, a.warmup).items():
                    figures.setdefault((buffers, row), {}).setdefault(name, []).append(t)
    base = a.arm[0][0]
    others = [n for n, _ in a.arm[1:]]
    print(f"| buffers | call | {' | '.join(f'{n} µs' for n, _ in a.arm)} | {' | '.join(f'{n} / {base}' for n in others)} |")
    print("|---|---|" + "---|" * (len(a.arm) + len(others)))
    for (buffers, row), by in figures.items():
        cells = [f"{statistics.median(by[n]):.3f}" for n, _ in a.arm]
        ratios = [f"{statistics.median(x / y for x, y in zip(by[n], by[base])):.3f}" for n in others]
        print(f"| {buffers} | {row} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    print(json.dumps({f"{b} {row}": by for (b, row), by in figures.items()}))


if __name__ == "__main__":
    main()
