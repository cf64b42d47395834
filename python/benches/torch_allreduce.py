"""torch.distributed all_reduce on CPU tensors, lockstep backend against gloo, 2 ranks forked by
lockstep.notebook_launcher (one CPU each), measured in one run.

Each size is measured in `--rounds` alternating rounds (lockstep, then gloo, then lockstep...), so
both see the same machine load; a round's figure is the median time per call over about
`--budget` seconds, and the table gives the median over rounds. `dist.all_reduce` is timed as a
user calls it: torch's Python wrapper included. "ordinary" tensors come from torch.ones; "shared"
ones from lockstep.torch.empty_shared (memory in the group's shared segment: zero-copy).

Two bounds are measured in the same run. For the smallest size, `dist.all_reduce` on a process
group whose allreduce does nothing: torch's own Python wrapper, which every backend pays. For the
largest size, a plain copy of that many bytes (`dst.copy_(src)`) on both ranks at once: what the
memory bandwidth (and the CPU share, on a loaded machine) allows at this moment (a staged
all-reduce moves about two such copies per rank, a zero-copy one about one).

    python python/benches/torch_allreduce.py [--ranks 2] [--sizes 8,4096,1048576,67108864] [--rounds 5]
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import lockstep
import lockstep.torch as lt


def timed(fn, budget_s, pg):
    """Median seconds per call of `fn()` over about `budget_s` (rank 0 picks the count)."""
    for _ in range(3):
        fn()
    dist.barrier(group=pg)
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    n = torch.tensor([max(5, min(20000, int(budget_s / max(one, 1e-7))))])
    dist.broadcast(n, src=0, group=pg)
    samples = []
    for _ in range(int(n.item())):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


class _Noop(dist.ProcessGroup):
    """A process group whose all-reduce does nothing: the cost of torch's wrapper alone."""

    def allreduce(self, tensors, opts=None):
        return None

    def getBackendName(self):
        return "noop"


def body(sizes, rounds, budget_s):
    torch.set_num_threads(1)
    gloo = dist.new_group(backend="gloo")
    dist.Backend.register_backend("noop", lambda o, _b=None: _Noop(o.group_rank, o.group_size), extended_api=True, devices=["cpu"])
    noop = dist.new_group(backend="noop")
    rows = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        s = lt.empty_shared(max(1, nbytes // 4)).fill_(1.0)
        ls, sh, gl = [], [], []
        for _ in range(rounds):
            ls.append(timed(lambda: dist.all_reduce(t), budget_s, None))
            sh.append(timed(lambda: dist.all_reduce(s), budget_s, None))
            gl.append(timed(lambda: dist.all_reduce(t, group=gloo), budget_s, gloo))
        rows.append(("all_reduce", nbytes, statistics.median(ls), statistics.median(sh), statistics.median(gl)))
    small, big = min(sizes), max(sizes)
    t = torch.ones(max(1, small // 4))
    wrapper = statistics.median(timed(lambda: dist.all_reduce(t, group=noop), budget_s, None) for _ in range(rounds))
    src, dst = torch.ones(max(1, big // 4)), torch.empty(max(1, big // 4))
    copy = statistics.median(timed(lambda: dst.copy_(src), budget_s, None) for _ in range(rounds))
    return rows, (small, wrapper), (big, copy)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="8,4096,1048576,67108864")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.6, help="seconds per size, backend and round")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    rows, (small, wrapper), (big, copy) = lockstep.notebook_launcher(body, args=(sizes, a.rounds, a.budget), num_processes=a.ranks)[0]
    print("| op | bytes | lockstep µs (ordinary) | lockstep µs (shared) | gloo µs | gloo / lockstep (ordinary) | gloo / lockstep (shared) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for op, nbytes, ls, sh, gl in rows:
        bw = lambda t: f"{t * 1e6:.1f}" + (f" ({nbytes / t / 1e9:.2f} GB/s)" if nbytes >= 1 << 20 else "")
        print(f"| {op} | {nbytes} | {bw(ls)} | {bw(sh)} | {bw(gl)} | {gl / ls:.1f}× | {gl / sh:.1f}× |")
    print(f"\nbounds: dist.all_reduce of {small} bytes on a no-op group (torch's wrapper) {wrapper * 1e6:.1f} µs; ", end="")
    print(f"copy of {big} bytes on every rank at once {copy * 1e6:.1f} µs ({big / copy / 1e9:.2f} GB/s per rank)")


if __name__ == "__main__":
    main()
