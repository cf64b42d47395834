"""torch.distributed all_reduce on CPU tensors, lockstep backend against gloo, 2 ranks forked by
lockstep.notebook_launcher, measured in one run (median time per call).

    python python/benches/torch_allreduce.py [--ranks 2] [--sizes 8,65536,67108864]
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import lockstep
import lockstep.torch  # noqa: F401


def measure(pg, nbytes, budget_s=1.5):
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    for _ in range(3):
        dist.all_reduce(t, group=pg)
    # Rank 0 picks the iteration count, so every rank runs the same number of calls.
    dist.barrier(group=pg)
    t0 = time.perf_counter()
    dist.all_reduce(t, group=pg)
    one = time.perf_counter() - t0
    n = torch.tensor([max(5, min(20000, int(budget_s / max(one, 1e-7))))])
    dist.broadcast(n, src=0, group=pg)
    samples = []
    for _ in range(int(n.item())):
        t0 = time.perf_counter()
        dist.all_reduce(t, group=pg)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def body(sizes):
    gloo = dist.new_group(backend="gloo")
    rows = []
    for nbytes in sizes:
        rows.append((nbytes, measure(None, nbytes), measure(gloo, nbytes)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="8,4096,1048576,67108864")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    rows = lockstep.notebook_launcher(body, args=(sizes,), num_processes=a.ranks)[0]
    print(f"| bytes | lockstep | gloo | gloo / lockstep |")
    print("|---:|---:|---:|---:|")
    for nbytes, ls, gl in rows:
        print(f"| {nbytes} | {ls * 1e6:.1f} µs ({nbytes / ls / 1e9:.2f} GB/s) | {gl * 1e6:.1f} µs ({nbytes / gl / 1e9:.2f} GB/s) | {gl / ls:.1f}× |")


if __name__ == "__main__":
    main()
