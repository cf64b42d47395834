#!/usr/bin/env python3
"""lockstep's Python package on CUDA tensors: two ranks forked by ``lockstep.notebook_launcher``
on the ``"lockstep"`` torch.distributed backend, both on one GPU when the machine has one (the
device communicator then stages through shared memory; with two GPUs each rank gets its own and
NCCL runs), then one rank alone (NCCL at world size 1, as torch's own backend), checking ``all_reduce`` (sum, average, bf16), ``broadcast``, ``all_gather`` (list and
tensor forms) and DDP for a few steps (the replicas stay identical and the loss falls).

Run by benches/gpu_verify.sh (step ``python``) with the wheel that benches/gpu_stage.sh built
unpacked on PYTHONPATH; it needs torch with CUDA, so it can only be syntax-checked without a GPU.
Prints one ``ok`` line per check and ``python torch CUDA: all checks passed``; exits 1 on the first
failure (a rank's failure arrives as ``lockstep.RankError`` with that rank's traceback).
``--cpu`` runs the same checks on CPU tensors, to rehearse the script on a machine without a GPU.

The parent never touches CUDA: notebook_launcher refuses to fork once CUDA is initialised in the
caller, so every CUDA call happens in the ranks.
"""

import os
import sys

import torch

import lockstep

WORLDS = (2, 1)
ON_CPU = "--cpu" in sys.argv[1:]
STEPS = 20


def rank_body():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lockstep.torch  # noqa: F401  (registers the backend; the launcher already did)

    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if ON_CPU:
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    out = {"device": str(dev), "backend": dist.get_backend()}

    t = torch.full((1001,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    out["sum"] = t.cpu()
    t = torch.full((1001,), float(rank + 1), device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["avg"] = t.cpu()
    h = torch.full((257,), float(rank + 1), device=dev, dtype=torch.bfloat16)
    dist.all_reduce(h)
    out["bf16"] = h.cpu()

    b = torch.arange(333, device=dev, dtype=torch.int64) if rank == world - 1 else torch.zeros(333, device=dev, dtype=torch.int64)
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b.cpu()

    mine = torch.full((4,), float(rank), device=dev)
    parts = [torch.empty(4, device=dev) for _ in range(world)]
    dist.all_gather(parts, mine)
    out["all_gather"] = [p.cpu() for p in parts]
    flat = torch.empty(4 * world, device=dev)
    dist.all_gather_into_tensor(flat, mine)
    out["all_gather_into_tensor"] = flat.cpu()

    # Which device communicator the group made at its first CUDA collective (information only).
    # The group may be lockstep's ProcessGroup itself or a wrapper around a per-device Backend.
    try:
        pg = dist.distributed_c10d._get_default_group()
        comm = getattr(pg, "_device_comm", None)
        if comm is None:
            comm = pg._get_backend(dev)._device_comm
        out["device_comm"] = comm.backend
    except Exception as e:  # the check does not depend on torch's private accessors
        out["device_comm"] = f"unknown ({type(e).__name__}: {e})"

    # DDP averages the gradients of the ranks' batches, so after each step every replica must
    # equal a plain model trained on all ranks' batches at once (same batch size per rank, mean
    # loss): a wrong or missing all-reduce of any bucket shows as a parameter difference.
    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(dev)

    def batch(r, step):
        g = torch.Generator(device=dev).manual_seed(1000 * step + r)
        x = torch.randn(64, 16, device=dev, generator=g)
        return x, x.sum(dim=1, keepdim=True)

    model, ref = make_model(), make_model()
    ddp = DDP(model, device_ids=None if ON_CPU else [dev.index], bucket_cap_mb=0.001)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.02)
    losses, worst = [], 0.0
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        xs, ys = zip(*(batch(r, step) for r in range(world)))
        ref_loss = torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys))
        ref_opt.zero_grad(set_to_none=True)
        ref_loss.backward()
        ref_opt.step()
        losses.append(ref_loss.item())
        for p, q in zip(model.parameters(), ref.parameters()):
            worst = max(worst, (p.detach() - q.detach()).abs().max().item())
    out["ddp_params"] = [p.detach().cpu() for p in model.parameters()]
    out["ddp_losses"] = losses
    out["ddp_vs_reference"] = worst
    if not ON_CPU:
        torch.cuda.synchronize(dev)
    return out


def check(name, cond, detail):
    if not cond:
        print(f"FAILED {name}: {detail}", flush=True)
        sys.exit(1)
    print(f"ok {name}", flush=True)


def run(world):
    res = lockstep.notebook_launcher(rank_body, num_processes=world)
    want_sum = float(world * (world + 1) // 2)
    for r, o in enumerate(res):
        w = f"world {world} rank {r}"
        print(f"{w}: {o['device']}, backend {o['backend']}, device communicator {o['device_comm']}", flush=True)
        if world == 1 and not ON_CPU:
            # A lone rank runs NCCL when it loads (the staged path is for ranks sharing a GPU).
            check(f"{w} device communicator", o["device_comm"] == "nccl", o["device_comm"])
        check(f"{w} all_reduce sum", torch.equal(o["sum"], torch.full((1001,), want_sum)), o["sum"][:4])
        check(f"{w} all_reduce avg", torch.equal(o["avg"], torch.full((1001,), (world + 1) / 2)), o["avg"][:4])
        check(f"{w} all_reduce bf16", torch.equal(o["bf16"], torch.full((257,), want_sum, dtype=torch.bfloat16)), o["bf16"][:4])
        check(f"{w} broadcast", torch.equal(o["broadcast"], torch.arange(333)), o["broadcast"][:4])
        gathered = torch.cat(o["all_gather"])
        want_g = torch.repeat_interleave(torch.arange(world, dtype=torch.float32), 4)
        check(f"{w} all_gather", torch.equal(gathered, want_g), gathered)
        check(f"{w} all_gather_into_tensor", torch.equal(o["all_gather_into_tensor"], want_g), o["all_gather_into_tensor"])
        losses = o["ddp_losses"]
        # v == v: not NaN; the means of five steps, since one rank's batch alone is noisy.
        learns = all(v == v for v in losses) and sum(losses[-5:]) < 0.5 * sum(losses[:5])
        check(f"{w} DDP learns", learns, losses)
        # TF32 is off by default for matmuls; the reference differs only in summation order.
        check(f"{w} DDP equals the single-process reference", o["ddp_vs_reference"] < 1e-4, o["ddp_vs_reference"])
        print(f"{w} DDP: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps; "
              f"largest difference from the reference {o['ddp_vs_reference']:.2e}", flush=True)
    for other in res[1:]:
        for a, b in zip(res[0]["ddp_params"], other["ddp_params"]):
            check(f"world {world} DDP replicas identical", torch.equal(a, b), (a - b).abs().max())


def main():
    assert not torch.cuda.is_initialized(), "CUDA must not be initialised before forking the ranks"
    for world in WORLDS:
        run(world)
    print(f"python torch {'CPU' if ON_CPU else 'CUDA'}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
