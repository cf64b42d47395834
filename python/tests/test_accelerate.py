"""Accelerate, unchanged, on the lockstep backend (CPU): an ``Accelerator(cpu=True)`` training
function (prepare, backward, gather_for_metrics, wait_for_everyone) under
``lockstep.notebook_launcher`` and under ``accelerate.notebook_launcher``, with the CPU setup of
docs/accelerate.md: the process group is initialised on "lockstep" before the Accelerator is made
(Accelerate's CPU path would pick gloo otherwise). Skipped without torch and accelerate."""

import json
import os

import pytest

from conftest import require_or_skip

try:
    import torch  # noqa: F401
    import accelerate  # noqa: F401
except ImportError:
    require_or_skip("torch and accelerate", "pip install torch accelerate")

import lockstep


def train(out_dir=None):
    """An Accelerate training function, as the tutorial writes one, plus the CPU setup's first lines."""
    import torch
    import torch.distributed as dist

    import lockstep.torch  # noqa: F401

    if not dist.is_initialized():
        dist.init_process_group("lockstep")  # the CPU setup: before the Accelerator
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = []
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        preds = [acc.gather_for_metrics(model(xb)) for xb, _ in loader]
    acc.wait_for_everyone()
    result = {
        "backend": dist.get_backend(),
        "num_processes": acc.num_processes,
        "rank": acc.process_index,
        "params": [p.detach().flatten().tolist() for p in acc.unwrap_model(model).parameters()],
        "gathered": sum(p.shape[0] for p in preds),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    if out_dir is not None:
        with open(os.path.join(out_dir, f"rank{acc.process_index}.json"), "w") as f:
            json.dump(result, f)
    return result


def check(results, world):
    assert sorted(r["rank"] for r in results) == list(range(world)), results
    for r in results:
        assert r["backend"] == "lockstep" and r["num_processes"] == world, r
        assert r["gathered"] == 96, r  # gather_for_metrics drops the padding of the last batch
        assert r["last_loss"] < r["first_loss"], r
    # DDP through lockstep keeps the replicas identical.
    assert all(r["params"] == results[0]["params"] for r in results), [r["params"][0][:3] for r in results]


def test_accelerate_under_lockstep_notebook_launcher():
    check(lockstep.notebook_launcher(train, num_processes=2), 2)


def test_accelerate_under_accelerates_notebook_launcher(tmp_path):
    from accelerate import notebook_launcher

    notebook_launcher(train, args=(str(tmp_path),), num_processes=2, use_port=str(_free_port()))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    check(results, 2)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_script_under_lockstep_launch(tmp_path):
    """The same function as a script under `lockstep launch` (torchrun's role: Accelerate's own
    `accelerate launch` starts a single process for CPU jobs and expects mpirun to start the rest)."""
    import shutil
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "from test_accelerate import train\ntrain(sys.argv[1])\n"
    )
    launcher = shutil.which("lockstep", path=os.path.dirname(sys.executable))
    assert launcher, "the package installs the lockstep command"
    o = subprocess.run(
        [launcher, "launch", "--nproc-per-node", "2", sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/tmp",
    )
    assert o.returncode == 0, o.stderr
    check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)], 2)
