"""Two builds of lockstep back to back: `lockstep bench` all-reduce and broadcast at 8 B, 1 MiB and
64 MiB on ordinary and shared (registered) buffers, 2 ranks, then a `train-cnn` epoch, each run
alternately with the two builds for `--rounds` rounds so both see the same machine; the figure
of a build is its median over rounds, and the table gives after / before.

    python3 benches/baselines/ab.py BEFORE_DIR AFTER_DIR [--rounds 3] [--epoch]

BEFORE_DIR and AFTER_DIR hold the `lockstep` and `train-cnn` binaries (target/release of each
build). Times are each rank's median per call (steadier than the mean on a shared machine),
averaged over the ranks, of the out-of-place call; the epoch time is train-cnn's `epoch_s`. The
base binary must know `--stat` (lockstep bench has had it since the statistics change).
"""

import argparse
import json
import os
import statistics
import subprocess

SIZES = "8,1M,64M"


def bench(bindir, op, buffers):
    out = subprocess.run(
        [os.path.join(bindir, "lockstep"), "bench", "--nprocs", "2", "--op", op, "--sizes", SIZES,
         "--buffers", buffers, "--format", "json", "-w", "5", "--stat", "median"],
        check=True, capture_output=True, text=True).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    return {r["size_bytes"]: r["out_of_place"]["time_us"] for r in doc["rows"]}


def epoch(bindir):
    out = subprocess.run(
        [os.path.join(bindir, "train-cnn"), "--epochs", "1", "--json"],
        check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("{") and '"epoch_s"' in line:
            return json.loads(line)["epoch_s"]
    raise RuntimeError("no epoch line in train-cnn's output:\n" + out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epoch", action="store_true", help="also time a train-cnn epoch (once per build per round)")
    a = ap.parse_args()
    cases = [(op, buf) for op in ("all_reduce", "broadcast") for buf in ("ordinary", "shared")]
    samples = {}
    for _ in range(a.rounds):
        for build, d in (("before", a.before), ("after", a.after)):
            for op, buf in cases:
                for size, t in bench(d, op, buf).items():
                    samples.setdefault((op, buf, size), {}).setdefault(build, []).append(t)
            if a.epoch:
                samples.setdefault(("train-cnn epoch", "", "s"), {}).setdefault(build, []).append(epoch(d))
    print(f"| case | buffers | size | before | after | after / before |")
    print(f"|---|---|---|---|---|---|")
    for (op, buf, size), v in samples.items():
        b, f = statistics.median(v["before"]), statistics.median(v["after"])
        unit = "s" if size == "s" else "µs"
        label = size if size == "s" else {8: "8 B", 1 << 20: "1 MiB", 64 << 20: "64 MiB"}.get(size, f"{size} B")
        print(f"| {op} | {buf} | {label} | {b:.2f} {unit} | {f:.2f} {unit} | {f / b:.3f} |")


if __name__ == "__main__":
    main()
