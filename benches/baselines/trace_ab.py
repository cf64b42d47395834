"""The flight recorder's cost: `lockstep bench` all_reduce at 8 B and 1 MiB, 2 ranks, ordinary buffers,
alternating three arms each round: a build of main, this build, and this build with
LOCKSTEP_TRACE_BUFFER=0 (the recorder off). The figure of an arm is its median over rounds.

    python3 benches/baselines/trace_ab.py MAIN/lockstep THIS/lockstep ROUNDS
"""
import json, os, statistics, subprocess, sys
main_bin, fr_bin, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
def bench(b, env_extra):
    env = dict(os.environ, **env_extra)
    out = subprocess.run([b, "bench", "--nprocs", "2", "--op", "all_reduce", "--sizes", "8,1M",
        "--format", "json", "-w", "5", "--stat", "median"], check=True, capture_output=True, text=True, env=env).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    return {r["size_bytes"]: r["out_of_place"]["time_us"] for r in doc["rows"]}
arms = [("main", main_bin, {}), ("recorder", fr_bin, {}), ("recorder off", fr_bin, {"LOCKSTEP_TRACE_BUFFER": "0"})]
s = {}
for _ in range(rounds):
    for name, b, e in arms:
        for size, t in bench(b, e).items():
            s.setdefault(size, {}).setdefault(name, []).append(t)
print("| size | main µs | recorder µs | recorder / main | recorder off / main |")
print("|---|---|---|---|---|")
for size, v in s.items():
    m = {k: statistics.median(x) for k, x in v.items()}
    print(f"| {size} B | {m['main']:.3f} | {m['recorder']:.3f} | {m['recorder']/m['main']:.3f} | {m['recorder off']/m['main']:.3f} |")
print(json.dumps(s))
