"""torch.distributed all_reduce on CPU tensors, lockstep backend against gloo and against torch's
no-op ``fake`` backend, 2 ranks forked by lockstep.notebook_launcher (one CPU each), measured in
one run.

Each size is measured in `--rounds` alternating rounds (every variant once per round, the order
turned by one each round), so all see the same machine load; a round's figure is the median time
per call over about `--budget` seconds, and the table gives the median over rounds. The bar against
``fake`` is the median over rounds of lockstep / fake within each round: the two are timed minutes
apart otherwise, and this machine's speed drifts more than the bar's margin in that time. `dist.all_reduce` is timed as a
user calls it: torch's Python wrapper included. "ordinary" tensors come from torch.ones; "shared"
ones from lockstep.torch.empty_shared (memory in the group's shared segment: zero-copy).

Bounds measured in the same rounds, at the smallest size:

- ``fake``: torch's own no-op backend (``torch.testing._internal.distributed.fake_pg``, C++):
  torch's wrapper and dispatch, which every backend pays, and nothing else.
- ``python no-op``: a Python c10d ``Backend`` whose allreduce returns a completed Work at once:
  what torch adds for any backend written in Python (its PyBackend trampoline, and the Flight
  Recorder hook torch attaches to every backend that does not record itself).
- the Python no-op again on a group whose Flight Recorder hook is removed
  (``TORCH_FR_BUFFER_SIZE=0`` does that for every group): the hook's share. lockstep records
  itself (``lockstep.torch.SELF_RECORDING``): torch attaches no hook to its groups; where it does
  (``LOCKSTEP_TRACE_BUFFER=0``, an older package), lockstep is measured without it too.

- ``lockstep Communicator.all_reduce_in_place``: the group's communicator called from Python
  directly, torch's wrapper, dispatcher and trampoline left out: lockstep's own share of a call,
  the two-rank exchange included.

At the largest size, a plain copy of that many bytes (`dst.copy_(src)`) on both ranks at once:
what the memory bandwidth (and the CPU share, on a loaded machine) allows at this moment (a staged
all-reduce moves about two such copies per rank, a zero-copy one about one).

The issue's bars are checked at the end: at the smallest size lockstep within 1.5x of ``fake``
and at least 20x faster than gloo; at the largest, at least 3x faster than gloo.

    python python/benches/torch_allreduce.py [--ranks 2] [--sizes 8,4096,1048576,67108864] [--rounds 5]
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import lockstep
import lockstep.torch as lt


DIRECT = "lockstep Communicator.all_reduce_in_place (no torch)"


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


def _python_noop_backend():
    """A Python c10d Backend whose allreduce does nothing: torch's cost for a Python backend."""
    from torch._C._distributed_c10d import Backend

    class PythonNoop(Backend):
        supports_coalescing = False
        supports_splitting = False

        def __init__(self, rank, size):
            Backend.__init__(self, rank, size)
            # An attribute, as lockstep's allreduce is (the trampoline finds it the same way).
            self.allreduce = lambda tensors, opts=None: lt._COMPLETED

        def getBackendName(self):
            return "python-noop"

    dist.Backend.register_backend("python-noop", lambda o, _b=None: PythonNoop(o.group_rank, o.group_size), extended_api=True, devices=["cpu"])


def _without_flight_recorder(pg):
    """`pg` with the Flight Recorder hook torch attached to it removed."""
    hooks = dist.distributed_c10d._world.pg_flight_recorder_hooks
    hook = hooks.pop(pg, None)
    if hook is not None:
        hook.remove()
    return pg


def body(sizes, rounds, budget_s):
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers "fake")

    torch.set_num_threads(1)
    gloo = dist.new_group(backend="gloo")
    fake = dist.new_group(backend="fake")
    bounds = {"fake": fake}
    if dist.group.WORLD in dist.distributed_c10d._world.pg_flight_recorder_hooks:
        bounds["lockstep, no FR hook"] = _without_flight_recorder(dist.new_group())
    if lt.PY_BACKEND:
        _python_noop_backend()
        bounds["python no-op"] = dist.new_group(backend="python-noop")
        bounds["python no-op, no FR hook"] = _without_flight_recorder(dist.new_group(backend="python-noop"))
    # lockstep's own share: the group's Communicator called directly, torch left out.
    try:
        comm = dist.group.WORLD._get_backend(torch.device("cpu")).comm
    except Exception:
        comm = None
    small, big = min(sizes), max(sizes)
    rows, bound_times, ratios = [], {name: [] for name in bounds}, []
    if comm is not None:
        bound_times[DIRECT] = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        s = lt.empty_shared(max(1, nbytes // 4)).fill_(1.0)
        ls, sh, gl = [], [], []
        for r in range(rounds):
            # Every variant once per round, the order turned by one each round, so no variant
            # always follows the same one (gloo's threads, a slow start) or always runs first.
            variants = [
                (ls, lambda: dist.all_reduce(t), None),
                (sh, lambda: dist.all_reduce(s), None),
                (gl, lambda: dist.all_reduce(t, group=gloo), gloo),
            ]
            if nbytes == small:
                variants += [(bound_times[name], lambda pg=pg: dist.all_reduce(t, group=pg), None) for name, pg in bounds.items()]
                if comm is not None:
                    variants.append((bound_times[DIRECT], lambda: comm.all_reduce_in_place(t, "sum"), None))
            k = r % len(variants)
            for out, fn, pg in variants[k:] + variants[:k]:
                out.append(timed(fn, budget_s, pg))
            if nbytes == small:
                # The bar's figure: lockstep over fake within one round (measured minutes apart,
                # the two would compare two states of a shared machine).
                ratios.append(ls[-1] / bound_times["fake"][-1])
        rows.append((nbytes, statistics.median(ls), statistics.median(sh), statistics.median(gl)))
    src, dst = torch.ones(max(1, big // 4)), torch.empty(max(1, big // 4))
    copy = statistics.median(timed(lambda: dst.copy_(src), budget_s, None) for _ in range(rounds))
    return rows, {n: statistics.median(v) for n, v in bound_times.items()}, (small, big, copy), ratios


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="8,4096,1048576,67108864")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.6, help="seconds per size, variant and round")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    rows, bounds, (small, big, copy), ratios = lockstep.notebook_launcher(body, args=(sizes, a.rounds, a.budget), num_processes=a.ranks)[0]
    print("| bytes | lockstep µs (ordinary) | lockstep µs (shared) | gloo µs | gloo / lockstep (ordinary) | gloo / lockstep (shared) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for nbytes, ls, sh, gl in rows:
        bw = lambda t: f"{t * 1e6:.1f}" + (f" ({nbytes / t / 1e9:.2f} GB/s)" if nbytes >= 1 << 20 else "")
        print(f"| {nbytes} | {bw(ls)} | {bw(sh)} | {bw(gl)} | {gl / ls:.1f}× | {gl / sh:.1f}× |")
    by = {n: (ls, sh, gl) for n, ls, sh, gl in rows}
    ls_small, _, gl_small = by[small]
    fake = bounds["fake"]
    print(f"\n| {small} B dist.all_reduce on | µs | / fake |")
    print("|---|---:|---:|")
    for name, t in [("lockstep", ls_small), *bounds.items()]:
        print(f"| {name} | {t * 1e6:.2f} | {t / fake:.2f}× |")
    paired = statistics.median(ratios)
    print(f"\nlockstep / fake within each round: median {paired:.2f}× (rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"\ncopy of {big} bytes on every rank at once {copy * 1e6:.1f} µs ({big / copy / 1e9:.2f} GB/s per rank)")
    ls_big, _, gl_big = by[big]
    checks = [
        (f"{small} B: lockstep / fake ≤ 1.5 (median of the rounds' ratios)", paired, paired <= 1.5),
        (f"{small} B: gloo / lockstep ≥ 20", gl_small / ls_small, gl_small / ls_small >= 20),
        (f"{big} B: gloo / lockstep ≥ 3", gl_big / ls_big, gl_big / ls_big >= 3),
    ]
    print()
    for what, ratio, ok in checks:
        print(f"bar {what}: {ratio:.2f}× {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
