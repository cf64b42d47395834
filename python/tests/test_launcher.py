"""notebook_launcher: results, rank exceptions, deaths, output, repeated calls, nothing left
behind, KeyboardInterrupt, and the refusal to fork once CUDA is initialised (fake driver)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import lockstep
from conftest import alive, children, launch, shm_entries

REPO = Path(__file__).resolve().parents[2]


def test_results_in_rank_order(no_leftovers):
    def body(scale, extra):
        c = lockstep.comm()
        return {"rank": c.rank, "pid": os.getpid(), "value": scale * c.rank, "extra": extra, "arr": np.arange(c.rank + 1)}

    res = launch(3, body, 10, None)
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert [r["value"] for r in res] == [0, 10, 20]
    assert all(r["extra"] is None for r in res)
    assert len({r["pid"] for r in res} | {os.getpid()}) == 4, "each rank is its own process"
    for r, d in enumerate(res):
        np.testing.assert_array_equal(d["arr"], np.arange(r + 1))


def test_default_is_two_ranks_and_none_results(no_leftovers):
    assert lockstep.notebook_launcher(lambda: None) == [None, None]


def test_large_result(no_leftovers):
    def body():
        return np.full(2_000_000, lockstep.comm().rank, np.float64)  # 16 MB each

    a, b = launch(2, body)
    assert a.shape == (2_000_000,) and a.sum() == 0 and b.sum() == 2_000_000


def test_five_calls_in_one_process(no_leftovers):
    def body(k):
        c = lockstep.comm()
        x = np.full(1000, float(c.rank + k))
        c.all_reduce(x)
        return float(x[0])

    for k in range(5):
        world = 2 + k % 2
        want = sum(r + k for r in range(world))
        assert launch(world, body, k) == [want] * world
        assert children() == set()


def test_rank_exception_raises_with_rank_and_traceback(no_leftovers):
    def failing_function():
        c = lockstep.comm()
        if c.rank == 1:
            raise ValueError("boom on purpose")
        c.barrier()  # rank 0 waits for rank 1, which never comes

    t0 = time.monotonic()
    with pytest.raises(lockstep.RankError) as e:
        launch(2, failing_function)
    assert time.monotonic() - t0 < 10, "the waiting rank must be stopped, not left to time out"
    err = e.value
    assert isinstance(err, RuntimeError)
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "rank 1 of 2 failed: ValueError: boom on purpose" in str(err)
    assert "failing_function" in err.traceback and 'raise ValueError("boom on purpose")' in err.traceback
    assert "_rank_main" not in err.traceback, "the traceback starts at the user's function"
    assert isinstance(err.__cause__, ValueError) and str(err.__cause__) == "boom on purpose"
    assert set(err.failures) <= {0, 1} and 1 in err.failures


def test_rank_that_exits_or_dies(no_leftovers):
    def exits():
        if lockstep.comm().rank == 0:
            print("about to leave", file=sys.stderr, flush=True)
            os._exit(3)
        return "fine"

    with pytest.raises(lockstep.RankError) as e:
        launch(2, exits)
    assert e.value.rank == 0 and "exited with code 3" in str(e.value) and "about to leave" in str(e.value)

    def killed():
        if lockstep.comm().rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return "fine"

    with pytest.raises(lockstep.RankError, match=r"rank 1 of 2 was killed by signal 9 \(SIGKILL\)"):
        launch(2, killed)


def test_peer_death_seen_by_the_waiting_rank_without_fail_fast(no_leftovers):
    def body():
        c = lockstep.comm()
        if c.rank == 1:
            os._exit(5)
        c.barrier()

    with pytest.raises(lockstep.RankError) as e:
        lockstep.notebook_launcher(body, num_processes=2, fail_fast=False)
    # Rank 0 is not killed: its own collective reports the dead peer, naming it.
    assert e.value.rank == 1
    assert "CommError" in e.value.failures[0] and "rank 1" in e.value.failures[0], e.value.failures


def test_comm_error_names_the_rank_it_follows(no_leftovers):
    def body():
        c = lockstep.comm()
        if c.rank == 1:
            c.close()  # leaves the communicator: rank 0's barrier reports it
            return None
        try:
            c.barrier()
        except lockstep.CommError as e:
            return (e.kind, e.follows, str(e))
        return "no error"

    first, second = launch(2, body)
    assert second is None
    kind, follows, msg = first
    assert (kind, follows) == ("peer_lost", 1), msg
    assert "rank 1" in msg


def test_root_cause_reported_when_the_consequence_arrives_first():
    # Both outcomes are in; the launcher happened to read rank 0's first (its pipe was registered
    # first): rank 0's CommError follows rank 1, which failed by itself, so rank 1 is reported.
    from lockstep import _launcher

    r0 = _launcher._Rank(0, 1, -1, -1, -1)
    r1 = _launcher._Rank(1, 2, -1, -1, -1)
    r0.outcome = ("err", "CommError", "rank 1 (pid 2) left the communicator while rank 0 was in barrier #1", "tb0\n", None, 1)
    r1.outcome = ("err", "ValueError", "boom", "tb1\n", None, None)
    r0.status, r1.status = 1, 1
    r1.stopped = True  # signalled by fail-fast after rank 0 was seen first, already exiting
    with pytest.raises(lockstep.RankError) as e:
        _launcher._collect([r0, r1], r0)
    assert e.value.rank == 1 and e.value.exc_type == "ValueError", str(e.value)
    assert "rank 1 of 2 failed: ValueError: boom" in str(e.value)
    assert "rank 0: CommError" in str(e.value)
    # Without the link (an error of its own), the first rank seen stays the one reported.
    r0.outcome = r0.outcome[:5] + (None,)
    with pytest.raises(lockstep.RankError) as e:
        _launcher._collect([r0, r1], r0)
    assert e.value.rank == 0
    # A rank the launcher stopped is not a cause: rank 0's error stays the report.
    r0.outcome = r0.outcome[:5] + (1,)
    r1.outcome = None
    with pytest.raises(lockstep.RankError) as e:
        _launcher._collect([r0, r1], r0)
    assert e.value.rank == 0 and "stopped by notebook_launcher after rank 0 failed" in e.value.failures[1]


def test_unpicklable_result_and_sys_exit(no_leftovers):
    with pytest.raises(lockstep.RankError, match="cannot be pickled"):
        launch(1, lambda: (lambda: 1))
    assert launch(2, lambda: sys.exit(0)) == [None, None]
    with pytest.raises(lockstep.RankError, match="SystemExit: 4"):
        launch(1, lambda: sys.exit(4))


class _FailsToUnpickle:
    """Pickles in the rank, raises when the caller unpickles it."""

    def __reduce__(self):
        return (_refuse_to_unpickle, ())


def _refuse_to_unpickle():
    raise ValueError("this result cannot be rebuilt in the caller")


def test_result_that_cannot_be_unpickled_is_a_rank_error(no_leftovers):
    with pytest.raises(lockstep.RankError) as e:
        launch(2, lambda: _FailsToUnpickle())
    # Both ranks fail alike; the error names whichever result the launcher read first.
    assert e.value.rank in (0, 1)
    assert "could not be unpickled here: ValueError: this result cannot be rebuilt in the caller" in str(e.value)
    assert set(e.value.failures) == {0, 1}


def test_output_is_prefixed(capsys, no_leftovers):
    def body():
        c = lockstep.comm()
        print(f"hello from {c.rank}")
        print(f"warning from {c.rank}", file=sys.stderr)
        os.write(1, f"raw write {c.rank}\npartial {c.rank}".encode())  # C-level output, no final newline
        c.barrier()

    launch(2, body)
    out, err = capsys.readouterr()
    for r in range(2):
        assert f"[rank {r}] hello from {r}\n" in out
        assert f"[rank {r}] raw write {r}\n" in out and f"[rank {r}] partial {r}\n" in out
        assert f"[rank {r}] warning from {r}\n" in err

    lockstep.notebook_launcher(lambda: print("x"), num_processes=1, log_line_prefix_template="<${rank}/${local_rank}> ")
    assert "<0/0> x\n" in capsys.readouterr().out


def test_environment_of_the_ranks(no_leftovers):
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_MIXED_PRECISION"]

    def body():
        return [os.environ.get(k) for k in keys]

    res = lockstep.notebook_launcher(body, num_processes=2, mixed_precision="bf16", use_port="29601")
    assert res[1] == ["1", "1", "2", "2", "127.0.0.1", "29601", "bf16"]
    assert "RANK" not in os.environ or os.environ.get("ACCELERATE_MIXED_PRECISION") != "bf16", "the caller's env is untouched"


def test_argument_checks():
    f = lambda: None  # noqa: E731
    with pytest.raises(ValueError, match="num_nodes"):
        lockstep.notebook_launcher(f, num_nodes=2)
    with pytest.raises(ValueError, match="max_restarts"):
        lockstep.notebook_launcher(f, max_restarts=-1)
    with pytest.raises(ValueError, match="max_restarts"):
        lockstep.notebook_launcher(f, max_restarts=True)
    with pytest.raises(ValueError, match="restart_policy='job'"):
        lockstep.notebook_launcher(f, max_restarts=1, restart_policy="rank")
    with pytest.raises(ValueError, match="restart_policy must be"):
        lockstep.notebook_launcher(f, max_restarts=1, restart_policy="node")
    with pytest.raises(ValueError, match="mixed_precision"):
        lockstep.notebook_launcher(f, mixed_precision="fp64")
    with pytest.raises(ValueError, match="num_processes"):
        lockstep.notebook_launcher(f, num_processes=0)
    with pytest.raises(TypeError, match="callable"):
        lockstep.notebook_launcher(42)
    assert children() == set()


def test_max_restarts_restarts_every_rank(no_leftovers, tmp_path):
    """A rank failing on the first attempt: every rank starts again, with both restart counts
    and a new segment, and the second attempt's values come back; without restarts the same
    function raises."""

    def body(d):
        c = lockstep.comm()
        k = os.environ["LOCKSTEP_RESTART_COUNT"]
        with open(os.path.join(d, f"seen.{c.rank}"), "a") as f:
            f.write(f"{k} {os.environ['TORCHELASTIC_RESTART_COUNT']} {os.environ['LOCKSTEP_REPLACEMENT']}\n")
        if k == "0" and c.rank == 1:
            raise ValueError("first attempt fails")
        x = np.array([c.rank + 1.0])
        c.all_reduce(x)
        return int(x[0])

    res = lockstep.notebook_launcher(body, (str(tmp_path),), num_processes=2, max_restarts=1)
    assert res == [3, 3]
    # Rank 1 writes before it fails; rank 0 may be stopped before it writes, on a loaded machine.
    assert (tmp_path / "seen.1").read_text().splitlines() == ["0 0 0", "1 1 0"]
    assert (tmp_path / "seen.0").read_text().splitlines()[-1] == "1 1 0"
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(lockstep.RankError, match="first attempt fails"):
        lockstep.notebook_launcher(body, (str(again),), num_processes=2)


def test_max_restarts_gives_up_after_n_restarts(no_leftovers, tmp_path, capfd):
    def body(d):
        c = lockstep.comm()
        with open(os.path.join(d, f"seen.{c.rank}"), "a") as f:
            f.write(os.environ["LOCKSTEP_RESTART_COUNT"] + "\n")
        if c.rank == 1:
            raise ValueError("always fails")
        c.all_reduce(np.zeros(1))  # fails (or is stopped) once rank 1 is gone

    with pytest.raises(lockstep.RankError, match="gave up: 2 of 2 restart") as e:
        lockstep.notebook_launcher(body, (str(tmp_path),), num_processes=2, max_restarts=2)
    assert "always fails" in str(e.value)
    # Rank 1 writes before it fails; rank 0 may be stopped before it writes, on a loaded machine.
    assert (tmp_path / "seen.1").read_text().splitlines() == ["0", "1", "2"]
    assert set((tmp_path / "seen.0").read_text().splitlines()) <= {"0", "1", "2"}
    assert "rank 1 (rank 1 of 2 failed: ValueError: always fails): every rank was stopped" in capfd.readouterr().err


def test_nested_launch_is_refused(no_leftovers):
    def body():
        with pytest.raises(RuntimeError, match="inside one of its own ranks"):
            lockstep.notebook_launcher(lambda: None)
        return "ok"

    assert launch(1, body) == ["ok"]


def test_malformed_lockstep_variable_refused(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_TIMEOUT_S", "soon")
    with pytest.raises(RuntimeError, match="LOCKSTEP_TIMEOUT_S"):
        launch(2, lambda: None)
    assert children() == set()


def run_script(code, env=None, timeout=60, **kw):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, **(env or {})),
        **kw,
    )


@pytest.mark.parametrize("how", ["process", "group"])
def test_keyboard_interrupt_stops_every_rank(how):
    """SIGINT to the calling process (a notebook's interrupt button), or to its whole process
    group (Ctrl-C in a terminal): KeyboardInterrupt reaches the caller, and every rank and
    everything the ranks started are gone."""
    script = textwrap.dedent(
        """
        import glob, os, signal, subprocess, sys, time
        import lockstep

        # A terminal or a notebook kernel handles SIGINT; a job started in the background by a
        # shell without job control (nohup, `cmd &` in a script) inherits it ignored, and
        # Python then keeps it ignored. The test is of the terminal's case wherever it runs.
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def body():
            c = lockstep.comm()
            p = subprocess.Popen(["sleep", "1000"])
            print("pids", os.getpid(), p.pid, flush=True)
            c.barrier()
            time.sleep(1000)

        try:
            lockstep.notebook_launcher(body, num_processes=2)
        except KeyboardInterrupt:
            kids = []
            for f in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
                kids += open(f).read().split()
            print("interrupted; children:", kids, flush=True)
            sys.exit(0)
        sys.exit(3)
        """
    )
    shm0 = shm_entries()
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = []
    deadline = time.monotonic() + 60
    try:
        while len(pids) < 4 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            if "pids" in line:
                pids += [int(x) for x in line.split("pids")[1].split()]
        assert len(pids) == 4, f"ranks did not start: {p.stderr.read() if p.poll() is not None else ''}"
        assert all(alive(q) for q in pids)
        if how == "process":
            os.kill(p.pid, signal.SIGINT)
        else:
            os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err}"
    assert "interrupted; children: []" in out, out
    time.sleep(0.2)
    assert [q for q in pids if alive(q)] == [], "a rank or a process it started survived"
    assert shm_entries() - shm0 == set()


def test_refuses_when_cuda_was_initialised_in_the_caller(fake_cuda):
    """Some library initialised CUDA in the caller (here: a ctypes call of cuInit, as pynvml or a
    device-count call would), while torch.cuda.is_initialized() would say False: refused before
    any fork, with lockstep's diagnosis. Driver merely loaded: allowed."""
    r = run_script(
        """
        import ctypes, glob, json, os
        import lockstep

        out = {}
        lib = ctypes.CDLL(os.environ["LOCKSTEP_CUDA_LIBRARY"])
        out["loaded_ok"] = lockstep.notebook_launcher(lambda: lockstep.comm().rank, num_processes=2)
        assert lib.cuInit(0) == 0
        try:
            lockstep.notebook_launcher(lambda: "forked anyway", num_processes=2)
            out["refused"] = None
        except RuntimeError as e:
            out["refused"] = str(e)
            out["type"] = type(e).__name__
        try:
            lockstep.check_fork_safe()
        except RuntimeError as e:
            out["check"] = str(e)
        kids = []
        for f in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
            kids += open(f).read().split()
        out["children"] = kids
        print(json.dumps(out))
        """,
        env={"LOCKSTEP_CUDA_LIBRARY": str(fake_cuda)},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["loaded_ok"] == [0, 1]
    msg = out["refused"]
    assert msg is not None, "notebook_launcher forked although CUDA was initialised"
    assert "CUDA was initialised in this process" in msg and "outside lockstep" in msg and str(fake_cuda) in msg, msg
    assert "To fix" in msg
    assert out["check"] == msg
    assert out["children"] == []


def test_init_from_env_under_torchrun_variables(no_leftovers):
    """Two separately started processes with torchrun's variables join one shared segment."""
    code = """
        import numpy as np, lockstep
        c = lockstep.init_from_env()
        x = np.full(5, c.rank + 1.0)
        c.all_reduce(x)
        print(c.rank, c.world_size, x.tolist())
        """
    port = str(20000 + os.getpid() % 20000)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(
                os.environ,
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                TORCHELASTIC_RUN_ID=f"pytest{os.getpid()}",
            ),
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        assert out.strip() == f"{r} 2 [3.0, 3.0, 3.0, 3.0, 3.0]"


def test_init_from_env_without_a_launcher():
    r = run_script(
        "import lockstep\ntry:\n    lockstep.init_from_env()\nexcept lockstep.CommError as e:\n    print('error:', e)\n",
        env={"RANK": "", "WORLD_SIZE": "", "LOCKSTEP_JOB_ID": ""},
    )
    assert r.returncode == 0, r.stderr
    assert "error:" in r.stdout and "no launcher variables found" in r.stdout, r.stdout


def test_init_from_env_under_lockstep_launch():
    """Under `lockstep launch` (the CLI of the Rust crate, when built in this checkout)."""
    exe = Path(os.environ.get("LOCKSTEP_BIN", REPO / "target" / "release" / "lockstep"))
    if not exe.exists():
        pytest.skip(f"skipped: {exe} not built (cargo build --release --bin lockstep)")
    code = "import numpy as np, lockstep\nc = lockstep.init_from_env()\nx = np.full(3, c.rank + 1.0)\nc.all_reduce(x, op='max')\nprint('result', c.rank, c.world_size, x.tolist())\n"
    r = subprocess.run(
        [str(exe), "launch", "--nproc-per-node", "3", "--", sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(3):
        assert f"result {rank} 3 [3.0, 3.0, 3.0]" in r.stdout, r.stdout
