#!/usr/bin/env python3
"""GPU baseline for `train-cnn --device cuda`: the same recipe three ways, side by side.

  1. PyTorch eager, whole dataset preloaded on the GPU (no DataLoader: batches are gathered by
     index on the device, as train-cnn does);
  2. PyTorch with torch.compile(mode="reduce-overhead") (CUDA graphs), same loop;
  3. train-cnn --device cuda --nprocs 1 (path given with --train-cnn).

Recipe (shared/seeds/002): FashionMNIST, pixels / 255, CNN module1/module2/linear1/linear2, Adam
lr 0.005, batch 64, 4 epochs, shuffled each epoch. Each runner reports seconds per epoch
(training + evaluation of the 10k test images, as train-cnn reports it) and test accuracy; the
table prints the median epoch time (the first epoch includes compilation/capture, so it is shown
separately) and the final accuracy.

Needs torch with CUDA. Dataset: --data DIR with the four .gz (or raw) IDX files, default
/usr/share/datasets/fashion-mnist.

    python3 benches/baselines/gpu_cnn.py --train-cnn target/release/train-cnn [--epochs 4]
        [--precision fp32|bf16] [--skip eager,compile,lockstep]

For fp32, PyTorch's defaults are kept (cuDNN convolutions may use TF32, matmuls do not) and
train-cnn uses its default TF32 tensor cores for both; pass --no-tf32 to turn TF32 off everywhere
(torch flags + LOCKSTEP_NVRTC_OPTIONS=-DLOCKSTEP_NO_TF32). --precision bf16 uses torch.autocast
(bfloat16) and train-cnn --precision bf16.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

from cnn_common import cnn_model, find, read_idx


def torch_run(args, compiled):
    import torch
    import torch.nn.functional as F

    if args.no_tf32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    torch.manual_seed(args.seed)
    # The whole dataset on the GPU as u8, like train-cnn; batches are gathered and scaled there.
    xtr = torch.from_numpy(read_idx(find(args.data, "train-images-idx3-ubyte")).copy()).to(dev)
    ytr = torch.from_numpy(read_idx(find(args.data, "train-labels-idx1-ubyte")).astype(np.int64)).to(dev)
    xte = torch.from_numpy(read_idx(find(args.data, "t10k-images-idx3-ubyte")).copy()).to(dev)
    yte = torch.from_numpy(read_idx(find(args.data, "t10k-labels-idx1-ubyte")).astype(np.int64)).to(dev)

    model = cnn_model().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    # reduce-overhead: Inductor kernels for forward and backward (AOTAutograd), replayed as CUDA
    # graphs; the optimizer stays eager (a fused multi-tensor Adam), as in typical use.
    net = torch.compile(model, mode="reduce-overhead") if compiled else model
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None) if compiled else None

    def train_step(xb, yb):
        if mark:
            mark()
        with amp:
            loss = F.cross_entropy(net(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    def eval_step(xb, yb):
        if mark:
            mark()
        with torch.no_grad(), amp:
            return (net(xb).argmax(1) == yb).sum()

    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    times, acc, loss_sum = [], 0.0, None
    n, b = xtr.shape[0], args.batch_size
    for epoch in range(args.epochs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.train()
        perm = torch.randperm(n, device=dev, generator=gen)
        loss_sum = torch.zeros((), device=dev)
        # The last partial batch (60000 = 937*64 + 32) compiles once for its own shape, as
        # train-cnn captures a second graph for it.
        for s in range(0, n, b):
            idx = perm[s : s + b]
            xb = xtr[idx].unsqueeze(1).float().div_(255.0)
            loss_sum += train_step(xb, ytr[idx]).float() * idx.numel()
        model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=dev)
        for s in range(0, xte.shape[0], b):
            xb = xte[s : s + b].unsqueeze(1).float().div_(255.0)
            correct += eval_step(xb, yte[s : s + b])
        acc = 100.0 * correct.item() / xte.shape[0]  # .item() synchronises
        times.append(time.perf_counter() - t0)
        print(f"  [{'compile' if compiled else 'eager'}] epoch {epoch + 1}/{args.epochs}  loss {loss_sum.item() / n:.4f}  test acc {acc:.2f} %  {times[-1]:.2f} s", flush=True)
    return times, acc


def lockstep_run(args):
    env = dict(os.environ)
    if args.no_tf32:
        env["LOCKSTEP_NVRTC_OPTIONS"] = "-DLOCKSTEP_NO_TF32"
    cmd = [args.train_cnn, "--device", "cuda", "--nprocs", "1", "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
           "--lr", str(args.lr), "--seed", str(args.seed), "--data", args.data, "--precision", args.precision, "--json"]
    print("  $ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"train-cnn failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    times, acc = [], 0.0
    for line in p.stdout.splitlines():
        m = re.search(r'"epoch_s":([0-9.]+)', line)
        a = re.search(r'"test_acc":([0-9.]+)', line)
        if m and a:
            times.append(float(m.group(1)))
            acc = float(a.group(1))
            print(f"  [lockstep] {line}", flush=True)
    if not times:
        sys.exit(f"train-cnn printed no epoch lines:\n{p.stdout}\n{p.stderr}")
    return times, acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-cnn", required=True, help="path of the train-cnn binary")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--no-tf32", action="store_true", help="exact f32 GEMMs in both (slower)")
    ap.add_argument("--skip", default="", help="comma list of eager,compile,lockstep to skip")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    rows = []
    # lockstep first: it must fork/initialise CUDA in its own process, and torch here would not
    # interfere anyway (separate process), but running it first keeps the GPU cold for nobody.
    if "lockstep" not in skip:
        rows.append(("train-cnn --device cuda", *lockstep_run(args)))
    if "eager" not in skip:
        rows.append(("pytorch eager (data on GPU)", *torch_run(args, False)))
    if "compile" not in skip:
        rows.append(("pytorch compile reduce-overhead", *torch_run(args, True)))
    try:
        import torch

        gpu = torch.cuda.get_device_name(0)
        ver = torch.__version__
    except Exception:  # noqa: BLE001 - informational only
        gpu, ver = "?", "?"
    print(f"\nFashionMNIST CNN, batch {args.batch_size}, Adam lr {args.lr}, {args.epochs} epochs, {args.precision}"
          f"{', TF32 off' if args.no_tf32 else ''}; GPU {gpu}; torch {ver}")
    print(f"{'runner':34} {'epoch 1 (s)':>12} {'median epoch (s)':>17} {'test acc (%)':>13}")
    for name, times, acc in rows:
        rest = times[1:] or times
        print(f"{name:34} {times[0]:12.2f} {statistics.median(rest):17.2f} {acc:13.2f}")


if __name__ == "__main__":
    main()
