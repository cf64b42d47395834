#!/usr/bin/env python3
"""torch.distributed (gloo) baseline for `lockstep bench`: same sizes and columns.

Usage: python3 gloo_bench.py --nprocs 2 --op all_reduce --sizes 8,1048576,67108864
Spawns the ranks itself (torch.multiprocessing); prints rank 0's table.
"""
import argparse, os, statistics, time


def rank_main(rank, n, op, sizes, port):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    if rank == 0:
        print(f"{'size(B)':>12} {'count':>12} {'type':>6} {'redop':>6} {'time(us)':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}")
    for size in sizes:
        count = max(size // 4, 1)
        x = torch.full((count,), float(rank % 3))
        if op == "all_gather":
            per = max(count // n, 1)
            x = torch.full((per,), float(rank))
            outs = [torch.empty(per) for _ in range(n)]
            call = lambda: dist.all_gather(outs, x)
        elif op == "reduce_scatter":
            per = max(count // n, 1)
            ins = [torch.full((per,), 1.0) for _ in range(n)]
            out = torch.empty(per)
            call = lambda: dist.reduce_scatter(out, ins)
        elif op == "broadcast":
            call = lambda: dist.broadcast(x, 0)
        else:
            y = x.clone()
            call = lambda: (y.copy_(x), dist.all_reduce(y))
        iters = min(max((1 << 30) // max(size, 1), 9), 200)
        for _ in range(3):
            call()
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t)
        med = torch.tensor([statistics.median(ts) * 1e6], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        t = med.item()
        algbw = size / (t * 1e-6) / 1e9
        f = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(op, 1.0)
        if rank == 0:
            print(f"{size:>12} {count:>12} {'f32':>6} {'sum':>6} {t:>10.2f} {algbw:>8.2f} {algbw * f:>8.2f} {0:>7}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--op", default="all_reduce")
    ap.add_argument("--sizes", default="8,1048576,67108864")
    a = ap.parse_args()
    import torch.multiprocessing as mp
    port = 29500 + os.getpid() % 1000
    mp.start_processes(rank_main, args=(a.nprocs, a.op, [int(s) for s in a.sizes.split(",")], port), nprocs=a.nprocs, start_method="fork")
