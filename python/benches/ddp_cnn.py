"""PyTorch's own DistributedDataParallel on the lockstep backend against gloo: the seed recipe's
FashionMNIST CNN (shared/seeds/002: Adam lr 0.005, batch 64 per rank, DistributedSampler), 2 CPU
ranks forked by lockstep.notebook_launcher, each with torch intra-op threads for its block of CPUs.

Both runs start from the same seed and see the same batches. They advance together, step by
step: a training step (loading its batch included) of one model, then the same step of the
other (which one goes first alternates), and likewise for the evaluation batches; each run's
epoch time is the sum of its own steps. So both are measured back to back under the same machine load, even on a machine
whose load changes by the second. With 2 ranks a sum of two gradients does not depend on the
order it is taken in, so both backends should give the same model and the same accuracy.

    python python/benches/ddp_cnn.py [--epochs 4] [--data /usr/share/datasets/fashion-mnist]
                                     [--train-limit N] [--ranks 2]

Prints one line per epoch and backend (time: training + evaluation) and a summary table.

Both backends run in the same rank processes, so they get the same CPUs and the same number of
torch intra-op threads: the script binds the ranks as lockstep's launcher does by default
(LOCKSTEP_CPU_BIND=block, unless set: each of N ranks on its own block of CPUs / N CPUs, one CPU
each with 2 ranks on 2 CPUs) and sets torch's intra-op threads to the size of that block. On a
machine shared with other jobs, LOCKSTEP_CPU_BIND=none lets the scheduler move a rank off a busy
CPU (the threads stay CPUs / N).
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

import lockstep
import lockstep.torch  # noqa: F401  (registers the backend; notebook_launcher then initialises it)

# The IDX reader and the CNN shared with benches/baselines/pytorch_cnn.py.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benches", "baselines"))
from cnn_common import cnn_model, find, read_idx  # noqa: E402


def load(data_dir, prefix, limit=None):
    import numpy as np

    x = read_idx(find(data_dir, f"{prefix}-images-idx3-ubyte")).astype(np.float32) / 255.0
    y = read_idx(find(data_dir, f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
    ds = TensorDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y))
    return Subset(ds, range(min(limit, len(ds)))) if limit else ds


class Run:
    """One training run: a DDP model on `group` with its optimiser and data loaders."""

    def __init__(self, name, group, args, train, test):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.name, self.group, self.rank, self.world = name, group, rank, world
        torch.manual_seed(args.seed)
        self.model = DDP(cnn_model(), process_group=group)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.sampler = DistributedSampler(train, world, rank, shuffle=True, seed=args.seed)
        self.train = DataLoader(train, batch_size=args.batch_size, sampler=self.sampler)
        self.test_len = len(test)
        self.test = DataLoader(test, batch_size=args.batch_size, sampler=DistributedSampler(test, world, rank, shuffle=False))

    def start(self, e):
        """Begin epoch `e`: training mode, a fresh shuffle, the clock at zero."""
        self.sampler.set_epoch(e)
        self.model.train()
        self.batches = iter(self.train)
        self.seconds = 0.0

    def train_step(self):
        """One training step (loading the batch included); False once the epoch's data is done."""
        t0 = time.perf_counter()
        try:
            x, y = next(self.batches)
        except StopIteration:
            return False
        loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.loss = loss.item()
        self.seconds += time.perf_counter() - t0
        return True

    def start_eval(self):
        self.model.eval()
        self.batches = iter(self.test)
        self.counts = torch.zeros(2, dtype=torch.int64)  # correct, seen (each test sample once)
        self.seen = 0

    def eval_step(self):
        t0 = time.perf_counter()
        try:
            x, y = next(self.batches)
        except StopIteration:
            return False
        with torch.no_grad():
            pred = self.model(x).argmax(1)
        # Positions rank + world*i past the end are DistributedSampler's padding.
        real = self.rank + self.world * (self.seen + torch.arange(len(y))) < self.test_len
        self.counts[0] += ((pred == y) & real).sum()
        self.counts[1] += real.sum()
        self.seen += len(y)
        self.seconds += time.perf_counter() - t0
        return True

    def finish(self):
        """The epoch's time and the test accuracy from the counts of every rank."""
        t0 = time.perf_counter()
        dist.all_reduce(self.counts, group=self.group)
        self.seconds += time.perf_counter() - t0
        return self.seconds, 100.0 * self.counts[0].item() / self.counts[1].item(), self.loss


def body(args):
    torch.set_num_threads(args.threads)
    cpus = sorted(os.sched_getaffinity(0))
    train = load(args.data, "train", args.train_limit)
    test = load(args.data, "t10k")
    runs = [Run("lockstep", None, args, train, test), Run("gloo", dist.new_group(backend="gloo"), args, train, test)]
    out = []
    for e in range(args.epochs):
        for r in runs:
            r.start(e)
        # Who goes first alternates: the second of a pair finds the batch's images in cache.
        i = 0
        while all([r.train_step() for r in (runs if i % 2 == 0 else runs[::-1])]):
            i += 1
        for r in runs:
            r.start_eval()
        while all([r.eval_step() for r in (runs if i % 2 == 0 else runs[::-1])]):
            i += 1
        for r in runs:
            dt, acc, loss = r.finish()
            if dist.get_rank() == 0:
                print(f"epoch {e + 1}/{args.epochs} {r.name:8s} {dt:7.1f} s  test acc {acc:.2f} %  loss {loss:.4f}", flush=True)
            out.append((e + 1, r.name, dt, acc))
    same = all(torch.equal(a, b) for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters()))
    return out, same, cpus, torch.get_num_threads()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-limit", type=int, default=None, help="train on the first N samples only (quick runs)")
    args = p.parse_args()
    # Set before the ranks are forked: they bind themselves when they join (lockstep's Python
    # package binds nothing unless asked).
    os.environ.setdefault("LOCKSTEP_CPU_BIND", "block")
    # The size of a rank's block: CPUs / ranks (at least 1).
    args.threads = max(1, len(os.sched_getaffinity(0)) // args.ranks)
    res = lockstep.notebook_launcher(body, args=(args,), num_processes=args.ranks)
    rows, same, cpus, threads = res[0]
    by = {(e, n): (dt, acc) for e, n, dt, acc in rows}
    print("\n| epoch | lockstep s | gloo s | gloo / lockstep | lockstep acc % | gloo acc % |")
    print("|---:|---:|---:|---:|---:|---:|")
    for e in range(1, args.epochs + 1):
        (lt, la), (gt, ga) = by[(e, "lockstep")], by[(e, "gloo")]
        print(f"| {e} | {lt:.1f} | {gt:.1f} | {gt / lt:.2f} | {la:.2f} | {ga:.2f} |")
    print(
        f"\nfinal parameters identical on both backends: {same}; rank 0 on CPUs {cpus} "
        f"(LOCKSTEP_CPU_BIND={os.environ['LOCKSTEP_CPU_BIND']}), {threads} torch intra-op thread(s) per rank for both backends"
    )


if __name__ == "__main__":
    main()
