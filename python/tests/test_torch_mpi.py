"""The torch backend across nodes: ``dist.init_process_group("lockstep")`` in 4 ranks started by
MPICH's ``mpiexec`` as 2 simulated nodes × 2 (``MPIR_CVAR_NUM_CLIQUES=2``, ``LOCKSTEP_MPI=on``)
gets the hierarchical backend (shared memory in each node, MPI between nodes), and its
collectives on CPU tensors are correct, all-reduce results bit-identical on every rank. The
program is unchanged from one run under torchrun: ``import lockstep.torch`` takes ``RANK`` and
``WORLD_SIZE`` from the launcher; ``MASTER_ADDR`` and ``MASTER_PORT`` are exported.

Skipped without torch (``skipped: torch not installed``) or without MPICH ≥ 5 (an ``mpiexec`` on
``PATH`` beside the MPI-5 ABI library ``libmpi_abi.so.1``, as ``pip install mpich`` installs
them: ``skipped: MPICH not installed``); ``LOCKSTEP_REQUIRE_MPI_ABI=1`` makes the latter a
failure."""

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import require_or_skip

try:
    import torch  # noqa: F401
except ImportError:
    require_or_skip("torch", "pip install torch")

import lockstep.torch as lt

# Every rank: join, check the backend, run the collectives, print one line.
RANK_PROGRAM = textwrap.dedent(
    r'''
    import os, sys
    import torch
    import torch.distributed as dist
    import lockstep.torch

    want_backend = sys.argv[1]
    dist.init_process_group("lockstep")
    rank, n = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["PMI_RANK"]) and n == int(os.environ["PMI_SIZE"]), (rank, n)
    comm = dist.group.WORLD._get_backend(torch.device("cpu")).comm
    assert comm.backend == want_backend, f"backend {comm.backend}, want {want_backend}"
    assert (comm.rank, comm.world_size) == (rank, n)

    def same_everywhere(t, what):
        """t's bytes are the same on every rank (bit-identical)."""
        bits = t.reshape(-1).view(torch.uint8)
        every = [torch.empty_like(bits) for _ in range(n)]
        dist.all_gather(every, bits)
        for r, b in enumerate(every):
            assert torch.equal(b, every[0]), f"{what}: rank {r}'s result differs from rank 0's"

    # all_reduce: exact sums of small integers (every dtype), and mixed magnitudes whose sum
    # depends on the order of additions (bit-identical on every rank), below and above the
    # leaders' 16 KiB path, in place.
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64):
        for numel in (3, 70_000):
            t = (torch.arange(numel) % 7 + rank).to(dtype)
            dist.all_reduce(t)
            want = (torch.arange(numel) % 7 * n + n * (n - 1) // 2).to(dtype)
            assert torch.equal(t, want), f"all_reduce sum {dtype} {numel}"
    for op, ref in ((dist.ReduceOp.MAX, lambda x: x.max(0).values), (dist.ReduceOp.MIN, lambda x: x.min(0).values)):
        t = torch.arange(1000, dtype=torch.float32) * (rank + 1) - 300 * rank
        every = torch.stack([torch.arange(1000, dtype=torch.float32) * (r + 1) - 300 * r for r in range(n)])
        dist.all_reduce(t, op=op)
        assert torch.equal(t, ref(every)), f"all_reduce {op}"
    for numel in (1000, 1 << 20):
        g = torch.Generator().manual_seed(1234 + rank)
        t = torch.randn(numel, generator=g) * torch.logspace(-4, 4, numel)
        dist.all_reduce(t)
        same_everywhere(t, f"all_reduce of {numel} mixed magnitudes")
        a = torch.randn(numel, dtype=torch.float64, generator=g)
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
        same_everywhere(a, f"all_reduce avg of {numel} float64")

    # broadcast from every root.
    for root in range(n):
        t = torch.full((50_000,), float(rank)) if rank == root else torch.zeros(50_000)
        dist.broadcast(t, src=root)
        assert torch.equal(t, torch.full((50_000,), float(root))), f"broadcast from {root}"

    # all_gather (a list of tensors, and into one tensor).
    mine = torch.arange(5000, dtype=torch.int64) + 10_000 * rank
    outs = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(outs, mine)
    for r in range(n):
        assert torch.equal(outs[r], torch.arange(5000, dtype=torch.int64) + 10_000 * r), f"all_gather block {r}"
    flat = torch.empty(n * 5000, dtype=torch.int64)
    dist.all_gather_into_tensor(flat, mine)
    assert torch.equal(flat, torch.cat(outs)), "all_gather_into_tensor"

    # reduce_scatter (a list, and one tensor).
    blocks = [torch.full((3000,), float(rank * 10 + j)) for j in range(n)]
    out = torch.empty(3000)
    dist.reduce_scatter(out, blocks)
    assert torch.equal(out, torch.full((3000,), float(sum(r * 10 + rank for r in range(n))))), "reduce_scatter"
    src = torch.cat(blocks)
    out2 = torch.empty(3000)
    dist.reduce_scatter_tensor(out2, src)
    assert torch.equal(out2, out), "reduce_scatter_tensor"

    # DDP: parameters broadcast from rank 0, gradients averaged.
    torch.manual_seed(rank)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    model(torch.full((2, 8), float(rank + 1))).sum().backward()
    grad = model.module.weight.grad.clone()
    same_everywhere(grad, "DDP's averaged gradient")
    assert torch.allclose(grad, torch.full_like(grad, 2.0 * (n + 1) / 2)), grad

    dist.barrier()
    print(f"rank {rank} of {n}: backend {comm.backend}: collectives ok", flush=True)
    dist.destroy_process_group()
    '''
)


def _mpiexec():
    """MPICH's mpiexec on PATH, with the MPI-5 ABI library pip puts beside it; or skip."""
    exe = shutil.which("mpiexec")
    lib = Path(exe).resolve().parent.parent / "lib" / "libmpi_abi.so.1" if exe else None
    if lib is None or not lib.exists():
        if os.environ.get("LOCKSTEP_REQUIRE_MPI_ABI") == "1":
            pytest.fail("LOCKSTEP_REQUIRE_MPI_ABI=1 but MPICH is not installed (pip install mpich; its bin on PATH)", pytrace=False)
        pytest.skip("skipped: MPICH not installed")
    return exe, lib


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_4(tmp_path, env_extra, want_backend):
    exe, lib = _mpiexec()
    prog = tmp_path / "rank.py"
    prog.write_text(RANK_PROGRAM)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        LOCKSTEP_MPI_LIBRARY=str(lib),
        LOCKSTEP_TIMEOUT_S="120",
        PYTHONPATH=os.pathsep.join(p for p in [str(Path(lt.__file__).parents[1]), env.get("PYTHONPATH", "")] if p),
        **env_extra,
    )
    p = subprocess.run(
        [exe, "-n", "4", sys.executable, str(prog), want_backend],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    shown = f"exit {p.returncode}\n--- stdout ---\n{p.stdout}\n--- stderr ---\n{p.stderr}"
    assert p.returncode == 0, shown
    for r in range(4):
        assert f"rank {r} of 4: backend {want_backend}: collectives ok" in p.stdout, shown


def test_two_nodes_by_two_join_through_mpi(tmp_path):
    """2 simulated nodes × 2 ranks: the hierarchical backend, every collective correct."""
    _run_4(tmp_path, {"MPIR_CVAR_NUM_CLIQUES": "2", "LOCKSTEP_MPI": "on"}, "hier")


def test_one_host_under_mpiexec_stays_on_shared_memory(tmp_path):
    """The same program under mpiexec on one host, LOCKSTEP_MPI left at auto: one shared-memory
    communicator (MPI is not needed when every rank shares the host)."""
    _run_4(tmp_path, {"LOCKSTEP_MPI": "auto"}, "shm")


def test_torch_variables_from_mpi_launchers():
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are taken from mpiexec's, mpirun's or
    srun's variables where RANK and WORLD_SIZE are unset, and never override torchrun's."""
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    lt._torch_vars_from_mpi(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    lt._torch_vars_from_mpi(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("2", "8", "0", "4")
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1"}
    lt._torch_vars_from_mpi(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "6", "1") and "LOCAL_WORLD_SIZE" not in env
    # torchrun inside an allocation: its variables stand.
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "RANK": "0", "WORLD_SIZE": "2"}
    lt._torch_vars_from_mpi(env)
    assert (env["RANK"], env["WORLD_SIZE"]) == ("0", "2") and "LOCAL_RANK" not in env
    env = {}
    lt._torch_vars_from_mpi(env)
    assert env == {}
