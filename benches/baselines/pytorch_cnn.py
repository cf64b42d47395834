#!/usr/bin/env python3
"""PyTorch baseline for `train-cnn`: the same recipe with DDP over gloo, 2 ranks x 1 thread.

Recipe (shared/seeds/002): FashionMNIST, pixels / 255, CNN module1/module2/linear1/linear2,
Adam lr 0.005, batch 64 per rank, 4 epochs, DistributedSampler (shuffle, seed + epoch),
test accuracy counted once per test sample (padding dropped, like gather_for_metrics).

Needs torch (not installed by lockstep; run it where torch is available). Reads the IDX files
directly so torchvision is not needed:

    python3 benches/baselines/pytorch_cnn.py [--data /usr/share/datasets/fashion-mnist] [--nprocs 2]

Prints one line per epoch: seconds (training + evaluation, as train-cnn reports) and accuracy.
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from cnn_common import cnn_model, find, read_idx


def load(data_dir, prefix):
    x = read_idx(find(data_dir, f"{prefix}-images-idx3-ubyte")).astype(np.float32) / 255.0
    y = read_idx(find(data_dir, f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
    return TensorDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y))


def worker(rank, world, args):
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(args.seed)
    train, test = load(args.data, "train"), load(args.data, "t10k")
    train_sampler = DistributedSampler(train, world, rank, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test, world, rank, shuffle=False)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test, batch_size=args.batch_size, sampler=test_sampler)
    model = DDP(cnn_model())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        t0 = time.time()
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        correct = torch.zeros(2, dtype=torch.int64)
        seen = 0
        with torch.no_grad():
            for x, y in test_loader:
                pred = model(x).argmax(1)
                # Positions rank + world*i beyond len(test) are DistributedSampler padding.
                n = len(y)
                pos = rank + world * (seen + torch.arange(n))
                real = pos < len(test)
                correct[0] += ((pred == y) & real).sum()
                correct[1] += real.sum()
                seen += n
        dist.all_reduce(correct)
        dt = time.time() - t0
        if rank == 0:
            acc = 100.0 * correct[0].item() / correct[1].item()
            print(f"epoch {epoch + 1}/{args.epochs}  loss {loss.item():.4f}  test acc {acc:.2f} %  {dt:.1f} s", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    mp.spawn(worker, args=(args.nprocs, args), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
