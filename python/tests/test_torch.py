"""torch CPU tensors, passed directly (read through data_ptr/numel/dtype) and through
`tensor.numpy()` (the buffer protocol), and the torch.distributed backend. Skipped when torch is
not installed (CI does not install it); LOCKSTEP_REQUIRE_TORCH=1 makes that a failure."""

import pytest

from conftest import require_or_skip

try:
    import torch
except ImportError:
    require_or_skip("torch", "pip install torch")

import lockstep


def test_torch_cpu_tensor_in_place_through_numpy():
    def body():
        c = lockstep.comm()
        t = torch.full((4, 3), float(c.rank + 1))
        c.all_reduce(t.numpy())  # in place: the tensor itself holds the sum
        g = torch.zeros(c.world_size * 2, dtype=torch.int64)
        c.all_gather(torch.full((2,), c.rank, dtype=torch.int64).numpy(), g.numpy())
        return t, g

    for t, g in lockstep.notebook_launcher(body, num_processes=2):
        assert torch.equal(t, torch.full((4, 3), 3.0))
        assert g.tolist() == [0, 0, 1, 1]


def test_torch_import_in_the_caller_does_not_block_forking():
    assert not torch.cuda.is_initialized()
    lockstep.check_fork_safe()
    assert lockstep.notebook_launcher(lambda: torch.ones(2).sum().item(), num_processes=2) == [2.0, 2.0]


def test_torch_tensors_directly_through_dlpack_including_bfloat16():
    def body():
        c = lockstep.comm()
        t = torch.full((5,), float(c.rank + 1), dtype=torch.bfloat16)
        c.all_reduce(t)  # no buffer protocol on tensors: DLPack
        out = torch.zeros(4, dtype=torch.float32)
        c.all_gather(torch.full((2,), float(c.rank)), out)
        with pytest.raises(ValueError, match="not C-contiguous"):
            c.all_reduce(torch.ones(4, 4).t())
        return t, out

    for t, out in lockstep.notebook_launcher(body, num_processes=2):
        assert t.dtype == torch.bfloat16 and torch.equal(t, torch.full((5,), 3.0, dtype=torch.bfloat16))
        assert out.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_torch_tensors_read_directly_and_refused_with_reasons():
    """Tensors are read through their own accessors (data_ptr, numel, dtype): parameters that
    require grad, every dtype lockstep has, views at an offset; other devices, int16 and
    non-contiguous tensors are refused on this rank and the peers' matching call fails."""

    def body():
        c = lockstep.comm()
        r = c.rank
        p = torch.nn.Parameter(torch.full((3,), float(r + 1)))
        c.all_reduce(p)
        out = {"param": p.detach().clone()}
        for dt in (torch.float64, torch.float16, torch.int8, torch.int32, torch.int64, torch.uint8):
            t = torch.full((2,), r + 1, dtype=dt)
            c.all_reduce(t, op="max")
            out[str(dt)] = t
        base = torch.zeros(8)
        view = base[4:]  # data_ptr is past the start of the storage
        view.fill_(r + 1)
        c.all_reduce(view)
        out["view"] = base
        errors = {}
        for name, bad in [("meta", torch.empty(4, device="meta")), ("int16", torch.ones(4, dtype=torch.int16)), ("strided", torch.ones(4, 4)[:, 0])]:
            with pytest.raises((TypeError, ValueError) if r == 0 else lockstep.CommError) as e:
                c.all_reduce(bad if r == 0 else torch.ones(4))
            errors[name] = (type(e.value).__name__, str(e.value))
        c.barrier()
        return out, errors

    for r, (out, errors) in enumerate(lockstep.notebook_launcher(body, num_processes=2)):
        assert out["param"].tolist() == [3.0] * 3
        for dt in ("torch.float64", "torch.float16", "torch.int8", "torch.int32", "torch.int64", "torch.uint8"):
            assert out[dt].tolist() == [2, 2], dt
        assert out["view"].tolist() == [0.0] * 4 + [3.0] * 4
        if r == 0:
            assert errors["meta"][0] == "TypeError" and "on meta" in errors["meta"][1] and ".cpu()" in errors["meta"][1]
            assert errors["int16"][0] == "TypeError" and "torch.int16 is not a lockstep element type" in errors["int16"][1]
            assert errors["strided"][0] == "ValueError" and "not C-contiguous" in errors["strided"][1]
        else:
            # The peer's refusal reaches this rank as an error naming rank 0 rather than a hang.
            for name, (kind, msg) in errors.items():
                assert kind == "CommError" and "rank 0 refused its all_reduce" in msg, (name, msg)


def test_unsupported_reduce_op_fails_on_every_rank():
    def body():
        import torch.distributed as dist

        op = dist.ReduceOp.BAND if dist.get_rank() == 0 else dist.ReduceOp.SUM
        with pytest.raises(Exception) as e:
            dist.all_reduce(torch.ones(4, dtype=torch.int64), op=op)
        dist.barrier()
        return type(e.value).__name__, str(e.value)

    (k0, m0), (k1, m1) = lockstep.notebook_launcher(body, num_processes=2)
    assert k0 == "ValueError" and "does not support reduce op" in m0, m0
    assert "rank 0" in m1, m1


def _collectives():
    import torch.distributed as dist

    r, n = dist.get_rank(), dist.get_world_size()
    out = {"init": (dist.is_initialized(), dist.get_backend(), n)}
    for op, name in [(dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.PRODUCT, "prod"), (dist.ReduceOp.MIN, "min")]:
        t = torch.arange(4, dtype=torch.float32) + r + 1
        dist.all_reduce(t, op=op)
        out[name] = t
    t = torch.full((3,), float(r))
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    out["async"] = (t, w.is_completed() and w.get_future().done(), [x.clone() for x in w.get_future().value()])
    b = torch.full((2,), float(r), dtype=torch.bfloat16)
    dist.all_reduce(b)
    out["bf16"] = b
    t = torch.full((2,), float(r))
    dist.broadcast(t, src=n - 1)
    out["broadcast"] = t
    t = torch.full((2,), float(r + 1))
    dist.reduce(t, dst=0)
    out["reduce"] = t
    lst = [torch.zeros(2) for _ in range(n)]
    dist.all_gather(lst, torch.full((2,), float(r)))
    out["all_gather"] = lst
    big = torch.zeros(2 * n, dtype=torch.int64)
    dist.all_gather_into_tensor(big, torch.full((2,), r, dtype=torch.int64))
    out["all_gather_into_tensor"] = big
    o = torch.zeros(2)
    dist.reduce_scatter(o, [torch.full((2,), float(r + 10 * j)) for j in range(n)])
    out["reduce_scatter"] = o
    o = torch.zeros(2)
    dist.reduce_scatter_tensor(o, torch.arange(2 * n, dtype=torch.float32) * (r + 1))
    out["reduce_scatter_tensor"] = o
    g = [torch.zeros(1) for _ in range(n)] if r == 0 else None
    dist.gather(torch.full((1,), float(r)), g, dst=0)
    out["gather"] = g
    s = torch.zeros(2)
    dist.scatter(s, [torch.full((2,), float(j * 7)) for j in range(n)] if r == 1 else None, src=1)
    out["scatter"] = s
    outs = [torch.zeros(1) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((1,), float(10 * r + j)) for j in range(n)])
    out["all_to_all"] = outs
    o = torch.zeros(n)
    dist.all_to_all_single(o, torch.arange(n, dtype=torch.float32) + 10 * r)
    out["all_to_all_single"] = o
    # Uneven: rank r sends j+1 rows to rank j.
    inp = torch.full((sum(j + 1 for j in range(n)), 2), float(r))
    o = torch.zeros(((r + 1) * n, 2))
    dist.all_to_all_single(o, inp, output_split_sizes=[r + 1] * n, input_split_sizes=[j + 1 for j in range(n)])
    out["all_to_all_uneven"] = o
    if r == 0:
        dist.send(torch.full((3,), 5.0), dst=1)
        req = dist.irecv(x := torch.zeros(3), src=1)
        req.wait()
        out["p2p"] = x
    elif r == 1:
        x = torch.zeros(3)
        dist.recv(x, src=0)
        dist.isend(x * 2, dst=0).wait()
        out["p2p"] = x
    dist.barrier()
    sub = dist.new_group([0, n - 1])
    if r in (0, n - 1):
        t = torch.full((2,), float(r))
        dist.all_reduce(t, group=sub)
        out["new_group"] = t
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_torch_distributed_on_the_lockstep_backend(world):
    res = lockstep.notebook_launcher(_collectives, num_processes=world)
    n = world
    for r, o in enumerate(res):
        assert o["init"] == (True, "lockstep", n)
        base = torch.arange(4, dtype=torch.float32)
        assert torch.equal(o["sum"], sum(base + q + 1 for q in range(n)))
        assert torch.equal(o["max"], base + n)
        prod = torch.ones(4)
        for q in range(n):
            prod = prod * (base + q + 1)
        assert torch.equal(o["prod"], prod)
        assert torch.equal(o["min"], base + 1)
        t, done, fut = o["async"]
        assert done and torch.equal(t, torch.full((3,), float(sum(range(n))))) and torch.equal(fut[0], t)
        assert o["bf16"].dtype == torch.bfloat16 and o["bf16"].float().tolist() == [float(sum(range(n)))] * 2
        assert o["broadcast"].tolist() == [float(n - 1)] * 2
        if r == 0:
            assert o["reduce"].tolist() == [float(sum(range(1, n + 1)))] * 2
            assert [x.item() for x in o["gather"]] == [float(q) for q in range(n)]
        assert [x.tolist() for x in o["all_gather"]] == [[float(q)] * 2 for q in range(n)]
        assert o["all_gather_into_tensor"].tolist() == [q for q in range(n) for _ in range(2)]
        assert o["reduce_scatter"].tolist() == [float(sum(q + 10 * r for q in range(n)))] * 2
        full = sum(torch.arange(2 * n, dtype=torch.float32) * (q + 1) for q in range(n))
        assert o["reduce_scatter_tensor"].tolist() == full[2 * r : 2 * r + 2].tolist()
        assert o["scatter"].tolist() == [float(r * 7)] * 2
        assert [x.item() for x in o["all_to_all"]] == [float(10 * q + r) for q in range(n)]
        assert o["all_to_all_single"].tolist() == [float(r + 10 * q) for q in range(n)]
        assert o["all_to_all_uneven"][:, 0].tolist() == [float(q) for q in range(n) for _ in range(r + 1)]
        if r == 0:
            assert o["p2p"].tolist() == [10.0] * 3
        if r == 1:
            assert o["p2p"].tolist() == [5.0] * 3
        if r in (0, n - 1):
            assert o["new_group"].tolist() == [float(n - 1)] * 2


def test_torch_mismatch_raises_naming_the_ranks():
    def body():
        import torch.distributed as dist

        with pytest.raises(RuntimeError) as e:
            dist.all_reduce(torch.ones(4 + dist.get_rank()))
        return str(e.value)

    for m in lockstep.notebook_launcher(body, num_processes=2):
        assert "mismatch" in m and "rank 0" in m and "rank 1" in m, m


def _ddp_train(backend, steps=20):
    """A small model trained with PyTorch's own DDP, from a fixed seed, on `backend`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    pg = dist.new_group(backend="gloo") if backend == "gloo" else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    ddp = DDP(model, process_group=pg)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def test_ddp_matches_gloo():
    def body():
        return _ddp_train("lockstep"), _ddp_train("gloo")

    res = lockstep.notebook_launcher(body, num_processes=2)
    (p_lock0, l_lock0), (p_gloo0, _) = res[0]
    (p_lock1, _), _ = res[1]
    for a, b in zip(p_lock0, p_lock1):
        assert torch.equal(a, b), "DDP keeps the replicas identical"
    for a, b in zip(p_lock0, p_gloo0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert l_lock0[-1] < l_lock0[0]


def _torchrun_pair(code, **env):
    """Run `code` in two fresh interpreters with torchrun's variables (rank 0 and 1 on a free
    loopback port, plus `env`); return each rank's (stdout, stderr), both having exited 0."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    return outs


def test_init_process_group_under_torchrun_variables():
    """Two processes started separately with torchrun's variables: init_process_group("lockstep")
    through env://, then a collective and a subgroup."""
    import textwrap

    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist, lockstep.torch
        dist.init_process_group("lockstep")
        t = torch.full((3,), float(dist.get_rank() + 1))
        dist.all_reduce(t)
        g = dist.new_group([0, 1])
        dist.all_reduce(t, group=g)
        print("ok", dist.get_rank(), dist.get_backend(), t.tolist())
        dist.destroy_process_group()
        """
    )
    for r, (out, _) in enumerate(_torchrun_pair(code)):
        assert f"ok {r} lockstep [6.0, 6.0, 6.0]" in out, out


def test_empty_shared_tensors_in_collectives():
    def body():
        import torch.distributed as dist

        import lockstep.torch as lt

        r = dist.get_rank()
        t = lt.empty_shared(512, 1024)  # 2 MiB: above the one-phase size, so the zero-copy path
        assert t.shape == (512, 1024) and t.dtype == torch.float32 and not t.any()
        t.fill_(r + 1)
        dist.all_reduce(t)
        b = lt.empty_shared((3,), dtype=torch.bfloat16)
        b.fill_(r)
        dist.broadcast(b, src=1)
        with pytest.raises(TypeError, match="lockstep backend"):
            lt.empty_shared(4, group=dist.new_group(backend="gloo"))
        return float(t.min()), float(t.max()), b.float().tolist()

    for lo, hi, b in lockstep.notebook_launcher(body, num_processes=2):
        assert lo == hi == 3.0
        assert b == [1.0] * 3


def test_init_process_group_finds_lockstep_without_importing_it():
    """torch >= 2.15 finds backends through the `torch.distributed.backends` entry points the
    wheel declares: a fresh interpreter that never imports lockstep initialises a group on it."""
    import subprocess
    import sys
    import textwrap

    from importlib.metadata import entry_points

    names = [e.name for e in entry_points(group="torch.distributed.backends")]
    assert "lockstep" in names, f"the installed package declares no torch.distributed.backends entry point: {names}"
    if not hasattr(torch.distributed.Backend, "_ensure_backend_registered"):
        pytest.skip(f"skipped: torch {torch.__version__} does not look up backend entry points (torch >= 2.15 does)")
    code = textwrap.dedent(
        """
        import sys, torch, torch.distributed as dist
        store = dist.HashStore()
        dist.init_process_group("lockstep", store=store, rank=0, world_size=1)
        t = torch.arange(4.0)
        dist.all_reduce(t)
        print("ok", dist.get_backend(), t.tolist())
        dist.destroy_process_group()
        """
    )
    o = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert o.returncode == 0, o.stderr
    assert "ok lockstep [0.0, 1.0, 2.0, 3.0]" in o.stdout, o.stdout


def _torchfrtrace(dump_dir):
    """torch's own reader of Flight Recorder dumps, torchfrtrace, on the files `rank_<r>` in
    `dump_dir`: its report (stdout and stderr)."""
    import os
    import shutil
    import subprocess
    import sys

    reader = shutil.which("torchfrtrace", path=os.path.dirname(sys.executable))
    assert reader, "torch installs the torchfrtrace console script"
    o = subprocess.run([reader, str(dump_dir), "-p", "rank_"], capture_output=True, text=True, timeout=120)
    assert o.returncode == 0, o.stderr
    return o.stdout + o.stderr


# Printed by each rank of the Flight Recorder tests: whether torch attached its recording hook to
# the default group, and whether lockstep is one of torch's self-recording backends.
_FR_HOOK_CHECK = """
hooks = dist.distributed_c10d._world.pg_flight_recorder_hooks
print("hooked", dist.group.WORLD in hooks, "self-recording", "lockstep" in dist.distributed_c10d._FR_SELF_RECORDING_BACKENDS)
"""


def _lockstep_dumps(dump_dir):
    """The ranks' dumps in `dump_dir` (rank_0, rank_1), checked to be lockstep's own."""
    import os
    import pickle

    assert sorted(os.listdir(dump_dir)) == ["rank_0", "rank_1"]
    for name in ("rank_0", "rank_1"):
        with open(os.path.join(dump_dir, name), "rb") as f:
            dump = pickle.load(f)
        assert dump["comm_lib_version"].startswith("lockstep "), dump
        assert dump["pg_config"]["0"]["ranks"] == "[0, 1]", dump


def _skip_fr_unless_self_recording():
    import lockstep.torch as lt

    if not lt.SELF_RECORDING:
        pytest.skip(f"skipped: torch {torch.__version__} has no self-recording Flight Recorder backends (torch >= 2.15 has)")


def test_flight_recorder_names_the_rank_that_skipped_a_collective(tmp_path):
    """Rank 1 calls a barrier where rank 0 makes its fifth all_reduce: both ranks fail with
    lockstep's mismatch error and dump the Flight Recorder (TORCH_FR_DUMP_ON_TIMEOUT=1) from
    lockstep's own recorder, torch's hook not attached; torch's own reader, torchfrtrace, names
    rank 1 and the collectives from the dumps."""
    import textwrap

    _skip_fr_unless_self_recording()
    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        dist.init_process_group("lockstep")
        r = dist.get_rank()
        """
    ) + _FR_HOOK_CHECK + textwrap.dedent(
        """
        t = torch.ones(4)
        for _ in range(4):
            dist.all_reduce(t)
        try:
            if r == 1:
                dist.barrier()
            else:
                dist.all_reduce(t)
        except RuntimeError as e:
            print("failed", r, "mismatch" in str(e))
        """
    )
    outs = _torchrun_pair(code, TORCH_FR_DUMP_ON_TIMEOUT="1", TORCH_FR_DUMP_TEMP_FILE=str(tmp_path / "rank_"))
    for r, (out, err) in enumerate(outs):
        assert "hooked False self-recording True" in out, out + err
        assert f"failed {r} True" in out, out + err
    _lockstep_dumps(tmp_path)
    report = _torchfrtrace(tmp_path)
    assert "Collective sequence number: 5 has errors" in report, report
    assert "Culprit rank 1" in report and "'all_reduce' does not match found collective type: 'barrier'" in report, report


def test_flight_recorder_names_the_rank_missing_from_a_timed_out_collective(tmp_path):
    """Rank 1 skips the fifth all_reduce: rank 0 times out in it and dumps the Flight Recorder
    (TORCH_FR_DUMP_ON_TIMEOUT=1), then rank 1 dumps its own through torch's entry point
    (_dump_fr_trace_file(rank, backend="lockstep")); both dumps come from lockstep's recorder,
    torch's hook not attached, and torchfrtrace names the missing rank and the collective."""
    import textwrap

    _skip_fr_unless_self_recording()
    code = textwrap.dedent(
        """
        import os, time
        from datetime import timedelta
        import torch, torch.distributed as dist
        dist.init_process_group("lockstep", timeout=timedelta(seconds=2))
        r = dist.get_rank()
        """
    ) + _FR_HOOK_CHECK + textwrap.dedent(
        """
        t = torch.ones(4)
        for _ in range(4):
            dist.all_reduce(t)
        if r == 0:
            try:
                dist.all_reduce(t)
            except RuntimeError as e:
                print("failed", r, e.kind)
        else:
            # Wait for rank 0 to time out and dump (rank 1 exiting sooner would make rank 0's
            # failure a lost peer instead).
            first = os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "0"
            deadline = time.monotonic() + 60
            while not os.path.exists(first) and time.monotonic() < deadline:
                time.sleep(0.02)
            import torch._C._distributed_c10d as c
            c._dump_fr_trace_file(r, backend="lockstep")
            print("dumped", r)
        """
    )
    outs = _torchrun_pair(code, TORCH_FR_DUMP_ON_TIMEOUT="1", TORCH_FR_DUMP_TEMP_FILE=str(tmp_path / "rank_"))
    for out, err in outs:
        assert "hooked False self-recording True" in out, out + err
    assert "failed 0 timeout" in outs[0][0], outs[0]
    assert "dumped 1" in outs[1][0], outs[1]
    _lockstep_dumps(tmp_path)
    report = _torchfrtrace(tmp_path)
    assert "Not all ranks joining collective, sequence number: 5" in report, report
    assert "missing ranks: {1}" in report and "collective: lockstep:all_reduce" in report, report


def test_flight_recorder_sigusr1_dumps_a_rank_stuck_in_a_collective(tmp_path):
    """SIGUSR1 with LOCKSTEP_TRACE_DIR and TORCH_FR_DUMP_TEMP_FILE set: rank 0 is stuck in its
    fifth all_reduce (rank 1 has not made it yet) when both ranks get the signal; lockstep's
    thread writes lockstep's trace files and torch's dumps, and torchfrtrace names rank 1 as
    missing from the collective. Then rank 1 joins and both finish."""
    import os
    import textwrap

    _skip_fr_unless_self_recording()
    code = textwrap.dedent(
        """
        import os, signal, time
        from datetime import timedelta
        import torch, torch.distributed as dist
        dist.init_process_group("lockstep", timeout=timedelta(seconds=60))
        r = dist.get_rank()
        store = dist.distributed_c10d._get_default_store()
        """
    ) + _FR_HOOK_CHECK + textwrap.dedent(
        """
        t = torch.ones(4)
        for _ in range(4):
            dist.all_reduce(t)
        if r == 0:
            store.set("pid0", str(os.getpid()))
        else:
            import pickle

            def dumped(rank, pid):
                # Signal `pid`, wait for its dump; its entries (None: no dump within 60 s).
                path = os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)
                if os.path.exists(path):
                    os.remove(path)
                os.kill(pid, signal.SIGUSR1)
                deadline = time.monotonic() + 60
                while not os.path.exists(path) and time.monotonic() < deadline:
                    time.sleep(0.02)
                with open(path, "rb") as f:
                    return pickle.load(f)["entries"]

            pid0 = int(store.get("pid0"))
            # Until rank 0's dump shows it inside its fifth all_reduce (it may not be there yet).
            while not any(e["collective_seq_id"] == 5 for e in dumped(0, pid0)):
                time.sleep(0.1)
            dumped(1, os.getpid())
        dist.all_reduce(t)
        print("done", r, t.tolist())
        """
    )
    fr, ls = tmp_path / "fr", tmp_path / "ls"
    fr.mkdir()
    ls.mkdir()
    outs = _torchrun_pair(code, LOCKSTEP_TRACE_DIR=str(ls), TORCH_FR_DUMP_TEMP_FILE=str(fr / "rank_"))
    for r, (out, err) in enumerate(outs):
        assert "hooked False self-recording True" in out, out + err
        assert f"done {r} [32.0, 32.0, 32.0, 32.0]" in out, out + err
    assert sorted(os.listdir(ls)) == ["rank00000.jsonl", "rank00001.jsonl"]
    _lockstep_dumps(fr)
    report = _torchfrtrace(fr)
    assert "Not all ranks joining collective, sequence number: 5" in report, report
    assert "missing ranks: {1}" in report and "collective: lockstep:all_reduce" in report, report


def test_flight_recorder_dump_entry_points_answer_for_lockstep():
    """torch's _dump_fr_trace and _dump_fr_trace_json, asked for backend="lockstep", return
    lockstep's recorder of the groups (every call so far, the subgroup's too); other backends'
    dumps are torch's."""
    import json
    import pickle

    _skip_fr_unless_self_recording()

    def body():
        import torch.distributed as dist
        import torch._C._distributed_c10d as c

        t = torch.ones(3, dtype=torch.float64)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        g = dist.new_group([0, 1])
        dist.all_gather_into_tensor(torch.empty(6, dtype=torch.float64), t, group=g)
        dist.barrier()
        return c._dump_fr_trace(backend="lockstep"), c._dump_fr_trace_json(backend="lockstep"), c._dump_fr_trace(backend="gloo")

    for rank, (raw, js, gloo) in enumerate(lockstep.notebook_launcher(body, num_processes=2)):
        dump = pickle.loads(raw)
        assert json.loads(js)["pg_config"] == dump["pg_config"]
        assert "lockstep" not in str(pickle.loads(gloo).get("entries", []))
        assert len(dump["pg_config"]) == 2, dump["pg_config"]
        ops = [(e["process_group"][0], e["collective_seq_id"], e["profiling_name"], e["input_sizes"], e["output_sizes"], e["input_dtypes"], e["state"]) for e in dump["entries"]]
        world, sub = sorted(dump["pg_config"], key=lambda n: n != "0")
        assert ops == [
            (world, 1, "lockstep:all_reduce", [[3]], [[3]], ["Double"], "completed"),
            (world, 2, "lockstep:broadcast", [[3]], [[3]], ["Double"], "completed"),
            (world, 3, "lockstep:barrier", [], [], [], "completed"),
            (sub, 1, "lockstep:all_gather", [[3]], [[6]], ["Double"], "completed"),
        ], (rank, ops)


def _ring_exchange():
    import torch.distributed as dist

    r, n = dist.get_rank(), dist.get_world_size()
    send = torch.full((5,), float(r))
    recv = torch.empty(5)
    # Every rank sends first: posted one at a time, blocking sends would wait on each other.
    ops = [dist.P2POp(dist.isend, send, (r + 1) % n), dist.P2POp(dist.irecv, recv, (r - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return recv


@pytest.mark.parametrize("world", [2, 3])
def test_batch_isend_irecv_ring(world):
    res = lockstep.notebook_launcher(_ring_exchange, num_processes=world)
    for r, got in enumerate(res):
        assert torch.equal(got, torch.full((5,), float((r - 1) % world))), (r, got)


def _timeouts():
    """Every scenario on its own group (a timed-out barrier aborts its group's communicator); the
    ranks meet on the default group between scenarios."""
    import re
    import time
    from datetime import timedelta

    import torch.distributed as dist

    r = dist.get_rank()
    cpu = lambda g: g._get_backend(torch.device("cpu"))  # noqa: E731
    out = {}
    # The group's timeout reaches its communicator; dist.set_timeout changes it.
    g = dist.new_group(timeout=timedelta(seconds=7))
    out["new_group"] = cpu(g).comm.timeout
    dist.set_timeout(timedelta(seconds=9), g)
    out["set_timeout"] = cpu(g).comm.timeout
    # Rank 0 alone in a barrier of a group with a 1 s timeout: torch's text, after 1 s.
    g = dist.new_group(timeout=timedelta(seconds=1))
    if r == 0:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            dist.barrier(group=g)
        out["barrier"] = (time.monotonic() - t0, str(e.value), e.value.kind, e.value.missing)
        assert re.search(" (Timed out|closed|timeout) ", str(e.value)), str(e.value)
    dist.barrier()
    if r != 0:
        with pytest.raises(RuntimeError) as e:  # aborted by rank 0
            dist.barrier(group=g)
        out["barrier"] = e.value.kind
    # barrier(timeout=...) overrides a long group timeout for one call.
    g = dist.new_group(timeout=timedelta(seconds=300))
    if r == 0:
        with pytest.raises(RuntimeError, match="Timed out waiting 200ms"):
            dist.barrier(group=g, timeout=timedelta(seconds=0.2))
    dist.barrier()
    # monitored_barrier that every rank reaches passes, also waiting for all.
    g = dist.new_group()
    dist.monitored_barrier(g, timeout=timedelta(seconds=30))
    dist.monitored_barrier(g, timeout=timedelta(seconds=30), wait_all_ranks=True)
    # Rank 1 skips: rank 0 names it, rank 2 says it got there.
    g = dist.new_group()
    if r != 1:
        with pytest.raises(RuntimeError) as e:
            dist.monitored_barrier(g, timeout=timedelta(seconds=0.5))
        out["monitored"] = str(e.value)
    dist.barrier()
    # Only rank 0 comes, waiting for all: it names both.
    g = dist.new_group()
    if r == 0:
        with pytest.raises(RuntimeError) as e:
            dist.monitored_barrier(g, timeout=timedelta(seconds=0.2), wait_all_ranks=True)
        out["wait_all"] = str(e.value)
    dist.barrier()
    # A zero timeout on rank 0 alone.
    g = dist.new_group()
    if r == 0:
        with pytest.raises(RuntimeError) as e:
            g.monitored_barrier(timedelta(seconds=0))
        out["zero"] = str(e.value)
    dist.barrier()
    return out


def test_torch_timeouts_and_monitored_barrier():
    """init_process_group/new_group's timeout, dist.set_timeout, barrier(timeout=) and
    monitored_barrier reach lockstep's communicator, and a timed-out (monitored) barrier raises
    the text torch's own tests expect of gloo."""
    res = lockstep.notebook_launcher(_timeouts, num_processes=3)
    for r, o in enumerate(res):
        assert o["new_group"] == 7.0 and o["set_timeout"] == 9.0, o
    waited, text, kind, missing = res[0]["barrier"]
    assert 0.9 <= waited < 30, waited
    assert "Timed out waiting 1000ms for rank(s) 1, 2" in text and kind == "timeout" and missing == [1, 2], text
    assert res[1]["barrier"] == res[2]["barrier"] == "aborted"
    assert res[0]["monitored"].startswith("Rank 1 failed to pass monitoredBarrier in 500 ms"), res[0]["monitored"]
    assert res[2]["monitored"].startswith(
        "Rank 2 successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0"
    ), res[2]["monitored"]
    assert res[0]["wait_all"].startswith("Ranks 1, 2 failed to pass monitoredBarrier in 200 ms"), res[0]["wait_all"]
    assert res[0]["zero"].startswith("Rank 0 timed out in monitoredBarrier"), res[0]["zero"]


def test_group_timeout_defers_to_lockstep_timeout_s_when_torch_default(monkeypatch):
    """A group made without a timeout (torch's default) keeps LOCKSTEP_TIMEOUT_S when it is set;
    an explicit timeout wins over it."""
    from datetime import timedelta

    monkeypatch.setenv("LOCKSTEP_TIMEOUT_S", "42")

    def body():
        import torch.distributed as dist

        cpu = lambda g: g._get_backend(torch.device("cpu")).comm.timeout  # noqa: E731
        return cpu(dist.group.WORLD), cpu(dist.new_group()), cpu(dist.new_group(timeout=timedelta(seconds=5)))

    for o in lockstep.notebook_launcher(body, num_processes=2):
        assert o == (42.0, 42.0, 5.0), o


def _sequence_numbers():
    import gc

    import torch.distributed as dist

    pg = dist.new_group()
    seqs = [pg._get_sequence_number_for_group()]
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)
    dist.broadcast(t, src=0, group=pg)
    seqs.append(pg._get_sequence_number_for_group())
    # torch's DETAIL mode wraps the backend and checks every collective's sequence number on all
    # ranks (through gloo) before running it.
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        detail = dist.new_group()
        wrapped = type(detail._get_backend(torch.device("cpu"))).__name__
        gc.collect()  # the wrapper holds the backend only from C++: it must stay alive anyway
        dist.all_reduce(t, group=detail)
        dist.barrier(group=detail)
        seqs.append(detail._get_sequence_number_for_group())
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    return seqs, wrapped, t.tolist()


def test_sequence_numbers_and_torch_distributed_debug_detail():
    res = lockstep.notebook_launcher(_sequence_numbers, num_processes=2)
    assert res[0] == res[1], res
    seqs, wrapped, t = res[0]
    assert seqs[1] == seqs[0] + 2 and seqs[2] == 2, seqs
    assert wrapped == "_ProcessGroupWrapper" and t == [4.0] * 3, res[0]


def _any_source():
    import torch.distributed as dist

    import lockstep.torch as lt

    r, n = dist.get_rank(), dist.get_world_size()
    got = []
    if r == 0:
        # dist.recv without a source returns the sender; dist.irecv's Work names it.
        for i in range(2 * (n - 1)):
            t = torch.full((4,), -1.0)
            if i % 2 == 0:
                src = dist.recv(t)
            else:
                w = dist.irecv(t)
                w.wait()
                src = w._source_rank()
            got.append((src, t.tolist()))
    else:
        for m in range(2):
            dist.send(torch.full((4,), 10.0 * r + m), dst=0)
    dist.barrier()
    # The ProcessGroup shape (torch before 2.15) answers recv_anysource itself.
    pg = dist.distributed_c10d._get_default_group()
    be = pg._get_backend(torch.device("cpu")) if lt.PY_BACKEND else pg
    old = lt.ProcessGroupLockstep(be.comm, r, n)
    if r == n - 1:
        dist.send(torch.full((2,), 7.0), dst=0)
    elif r == 0:
        t = torch.zeros(2)
        w = old.recv_anysource([t], 0)
        w.wait()
        got.append((w._source_rank(), t.tolist()))
    dist.barrier()
    return got


def test_recv_from_any_source_names_the_sender():
    n = 3
    got = lockstep.notebook_launcher(_any_source, num_processes=n)[0]
    *received, last = got
    assert sorted(src for src, _ in received) == [q for q in range(1, n) for _ in range(2)], got
    for q in range(1, n):
        # Each payload is its reported sender's, in the order that rank sent them.
        assert [t for src, t in received if src == q] == [[10.0 * q] * 4, [10.0 * q + 1] * 4], got
    assert last == (n - 1, [7.0, 7.0]), got


def _async_works():
    import torch.distributed as dist

    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    t = torch.full((3,), float(r))
    w = dist.all_reduce(t, async_op=True)
    # Completed when the call returns (before wait), and still after.
    out["all_reduce"] = (w.is_completed(), w.wait(), w.is_completed(), w.is_success(), w.exception(), t.tolist())
    w = dist.broadcast(torch.zeros(2), src=0, async_op=True)
    out["broadcast"] = w.is_completed()
    w = dist.barrier(async_op=True)
    out["barrier"] = w.is_completed()
    if r == 0:
        ws = [dist.isend(torch.full((2,), 5.0), dst) for dst in range(1, n)]
        for w in ws:
            w.wait()
        out["p2p"] = [w.is_completed() for w in ws]
    else:
        t = torch.zeros(2)
        w = dist.irecv(t, 0)
        w.wait()
        out["p2p"] = [w.is_completed(), t.tolist()]
    # Blocking calls still return None to the caller.
    out["blocking"] = dist.all_reduce(torch.ones(1))
    # A group of another backend keeps torch's own Work, whose state is its own.
    g = dist.new_group(list(range(n)), backend="gloo")
    w = dist.all_reduce(torch.ones(1), group=g, async_op=True)
    w.wait()
    out["gloo"] = (type(w).__name__, w.is_completed())
    dist.barrier()
    return out


def test_async_work_is_completed():
    """torch 2.15 hands a Python Backend's Work back in a holder whose is_completed() stayed
    False after the call completed (torch's suite: test_isend, test_irecv)."""
    n = 3
    for r, o in enumerate(lockstep.notebook_launcher(_async_works, num_processes=n)):
        assert o["all_reduce"] == (True, True, True, True, None, [float(sum(range(n)))] * 3), (r, o)
        assert o["broadcast"] and o["barrier"], (r, o)
        assert o["p2p"] == ([True] * (n - 1) if r == 0 else [True, [5.0, 5.0]]), (r, o)
        assert o["blocking"] is None, (r, o)
        assert o["gloo"] == ("Work", True), (r, o)


def _splits(bound):
    import torch.distributed as dist

    r = dist.get_rank()
    if bound:
        # A default group bound to a device: torch makes new groups by splitting it.
        dist.destroy_process_group()
        dist.init_process_group("lockstep", device_id=torch.device("cpu:0"))
    out = {}
    # Rank 1 is left out; the new group's ranks follow the list's order.
    g = dist.split_group(split_ranks=[[2, 0]])
    if r == 1:
        out["left_out"] = g is dist.GroupMember.NON_GROUP_MEMBER
    else:
        t = torch.full((2,), float(r + 1))
        dist.all_reduce(t, group=g)
        out["members"] = (dist.get_rank(g), dist.get_process_group_ranks(g), t.tolist())
    # Two disjoint groups at once.
    g = dist.split_group(split_ranks=[[0], [1, 2]])
    t = torch.full((1,), float(r + 1))
    dist.all_reduce(t, group=g)
    out["disjoint"] = (dist.get_world_size(g), t.item())
    g = dist.new_group([1, 2])
    if r != 0:
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
        out["new_group"] = t.item()
    be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    out["count"] = be.comm_split_count()
    dist.barrier()
    return out


@pytest.mark.parametrize("bound", [False, True])
def test_split_group(bound):
    """dist.split_group (torch 2.15): members join a new communicator, ranks left out return
    at once (torch's trampoline crashed when a Python Backend's split returned None); new_group
    on a default group bound to a device counts a split on every rank alike."""
    import lockstep.torch as lt

    if not lt.PY_BACKEND:
        pytest.skip(f"skipped: torch {torch.__version__} dispatches no Python Backend (torch >= 2.15 does)")
    res = lockstep.notebook_launcher(_splits, args=(bound,), num_processes=3)
    assert res[1]["left_out"], res
    assert res[0]["members"] == (1, [2, 0], [4.0, 4.0]) and res[2]["members"] == (0, [2, 0], [4.0, 4.0]), res
    assert [o["disjoint"] for o in res] == [(1, 1.0), (2, 5.0), (2, 5.0)], res
    assert res[1]["new_group"] == 2.0 and res[2]["new_group"] == 2.0, res
    # Each split_group counts on every rank (left out or not); a bound group's new_group too.
    assert [o["count"] for o in res] == [3 if bound else 2] * 3, res


def _sparse_and_ddp_name():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    # Rank r holds entries 0..r of a 1-d sparse tensor, and of a 2-d one with a dense dimension.
    t = torch.sparse_coo_tensor(torch.arange(r + 1).reshape(1, -1), torch.ones(r + 1), (n,))
    dist.all_reduce(t)
    out["sparse"] = (t.is_sparse, t.to_dense().tolist())
    t = torch.sparse_coo_tensor(torch.arange(r + 1).reshape(1, -1), torch.full((r + 1, 2), float(r + 1)), (n, 2))
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    out["sparse_dense_dim"] = t.to_dense().tolist()
    # A rank with no entries.
    t = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64), torch.zeros(0), (n,)) if r == 0 else torch.sparse_coo_tensor([[r]], [float(r)], (n,))
    dist.all_reduce(t)
    out["empty"] = t.to_dense().tolist()
    with pytest.raises(ValueError) as e:
        dist.all_reduce(torch.sparse_coo_tensor([[0]], [1.0], (n,)), op=dist.ReduceOp.MAX)
    out["max"] = str(e.value)
    model = DDP(torch.nn.Linear(2, 2))
    out["ddp_backend_name"] = model._get_ddp_logging_data().get("backend_name")
    dist.barrier()
    return out


def test_sparse_all_reduce_and_ddp_logging_name():
    """Sparse COO all-reduce sums as gloo's (torch's suite: test_sparse_all_reduce_sum), and
    DDP's logging data names the backend (test_ddp_logging_data_cpu)."""
    n = 3
    for o in lockstep.notebook_launcher(_sparse_and_ddp_name, num_processes=n):
        assert o["sparse"] == (True, [float(n - q) for q in range(n)]), o
        assert o["sparse_dense_dim"] == [[float(sum(r + 1 for r in range(q, n)))] * 2 for q in range(n)], o
        assert o["empty"] == [float(q) for q in range(n)], o
        assert "SUM only" in o["max"], o
        assert o["ddp_backend_name"] == "lockstep", o
