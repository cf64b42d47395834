#!/usr/bin/env python3
"""Run `lockstep bench` and each available baseline back to back and print ratios.

Usage: python3 benches/baselines/compare.py [--nprocs 2] [--sizes 8,1048576,67108864] [--rounds 3]

Baselines: Open MPI (benches/baselines/mpi_bench.c, built with mpicc when present) and
torch.distributed gloo (benches/baselines/gloo_bench.py, when torch imports). Each round runs
every tool once per op, alternating, and the median busbw / time over rounds is compared, since
this machine's memory bandwidth drifts over minutes.
"""
import argparse, os, shutil, statistics, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def parse(out):
    rows = {}
    for line in out.splitlines():
        f = line.split()
        # lockstep bench: nccl-tests' 13 columns (size count type redop root, then time algbw busbw
        # #wrong out of place and in place); the baselines: 8 (size count type op time algbw busbw #wrong).
        if len(f) == 13 and f[0].isdigit():
            rows[int(f[0])] = (float(f[5]), float(f[7]), int(f[8]))
        elif len(f) == 8 and f[0].isdigit():
            rows[int(f[0])] = (float(f[4]), float(f[6]), int(f[7]))
    return rows


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return parse(p.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--sizes", default="8,1048576,67108864")
    ap.add_argument("--ops", default="all_reduce,broadcast,all_gather,reduce_scatter")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    lockstep = os.path.join(ROOT, "target", "release", "lockstep")
    if not os.path.exists(lockstep):
        subprocess.run(["cargo", "build", "--release", "--bin", "lockstep"], cwd=ROOT, check=True)
    tools = {}
    for buffers in ["ordinary", "shared"]:
        tools[f"lockstep/{buffers}"] = lambda op, b=buffers: [lockstep, "bench", "--nprocs", str(a.nprocs), "--op", op, "--sizes", a.sizes, "--buffers", b]
    if shutil.which("mpicc") and shutil.which("mpirun"):
        exe = "/tmp/lockstep_mpi_bench"
        subprocess.run(["mpicc", "-O2", "-o", exe, os.path.join(HERE, "mpi_bench.c")], check=True)
        extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        tools["openmpi"] = lambda op: ["mpirun", *extra, "--oversubscribe", "-np", str(a.nprocs), exe, op, a.sizes]
    else:
        print("# Open MPI not found (apt-get install openmpi-bin libopenmpi-dev): skipped")
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0:
        tools["gloo"] = lambda op: [sys.executable, os.path.join(HERE, "gloo_bench.py"), "--nprocs", str(a.nprocs), "--op", op, "--sizes", a.sizes]
    else:
        print("# torch not importable: gloo baseline skipped")
    results = {}
    for op in a.ops.split(","):
        for _ in range(a.rounds):
            for name, cmd in tools.items():
                for size, v in run(cmd(op)).items():
                    results.setdefault((op, name, size), []).append(v)
    base_names = [t for t in tools if not t.startswith("lockstep")]
    print(f"\n# {a.nprocs} ranks, f32 sum, median of {a.rounds} back-to-back rounds; busbw in GB/s, time in us")
    hdr = f"{'op':<15}{'size(B)':>11}  {'tool':<18}{'time(us)':>10}{'busbw':>8}{'#wrong':>7}"
    for b in base_names:
        hdr += f"{'x' + b:>12}"
    print(hdr)
    for op in a.ops.split(","):
        for size in sorted({k[2] for k in results if k[0] == op}):
            for name in tools:
                vals = results.get((op, name, size))
                if not vals:
                    continue
                t = statistics.median(v[0] for v in vals)
                bw = statistics.median(v[1] for v in vals)
                wrong = max(v[2] for v in vals)
                line = f"{op:<15}{size:>11}  {name:<18}{t:>10.2f}{bw:>8.2f}{wrong:>7}"
                if name.startswith("lockstep"):
                    for b in base_names:
                        bv = results.get((op, b, size))
                        if bv:
                            bt = statistics.median(v[0] for v in bv)
                            # Speed-up: baseline time / lockstep time (same as busbw ratio).
                            line += f"{bt / t:>11.2f}x"
                print(line)


if __name__ == "__main__":
    main()
