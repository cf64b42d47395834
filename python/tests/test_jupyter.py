"""notebook_launcher in a real Jupyter kernel (ipykernel, driven through jupyter_client): rank
output shows in the cell, results come back, the interrupt button stops every rank, and the kernel
can launch again afterwards. Skipped when ipykernel or jupyter_client is not installed."""

import os
import queue
import re
import time

import pytest
from conftest import alive

try:
    import ipykernel  # noqa: F401
    from jupyter_client.manager import start_new_kernel
except ImportError:
    pytest.skip("skipped: ipykernel or jupyter_client not installed", allow_module_level=True)


def run_cell(kc, code, timeout=60, on_output=None):
    """Execute `code`; return (stdout text, stderr text, error or None)."""
    msg_id = kc.execute(code)
    out, err, error = [], [], None
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"cell did not finish in {timeout} s; output so far: {''.join(out)} {''.join(err)}")
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        t, c = msg["msg_type"], msg["content"]
        if t == "stream":
            (out if c["name"] == "stdout" else err).append(c["text"])
            if on_output:
                on_output("".join(out))
        elif t == "error":
            error = (c["ename"], c["evalue"])
        elif t == "status" and c["execution_state"] == "idle":
            return "".join(out), "".join(err), error


def test_notebook_kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        out, err, error = run_cell(
            kc,
            """
import os, sys, lockstep, numpy as np
def train(n):
    c = lockstep.comm()
    x = np.full(n, c.rank + 1.0)
    c.all_reduce(x)
    print(f"sum {x[0]}")
    print("to stderr", file=sys.stderr)
    return float(x.sum())
res = lockstep.notebook_launcher(train, args=(4,), num_processes=2)
print("results", res)
""",
        )
        assert error is None, (error, out, err)
        assert "[rank 0] sum 3.0" in out and "[rank 1] sum 3.0" in out, out
        assert "[rank 1] to stderr" in err, err
        assert "results [12.0, 12.0]" in out, out

        # The interrupt button while ranks run (and started processes of their own).
        pids = []

        def watch(text):
            pids[:] = [int(p) for p in re.findall(r"pid (\d+)", text)]
            if len(pids) == 4:
                km.interrupt_kernel()

        out, err, error = run_cell(
            kc,
            """
import subprocess, time
def hang():
    p = subprocess.Popen(["sleep", "1000"])
    print("pid", os.getpid(), "pid", p.pid, flush=True)
    time.sleep(1000)
lockstep.notebook_launcher(hang, num_processes=2)
""",
            on_output=watch,
        )
        assert error is not None and error[0] == "KeyboardInterrupt", (error, out, err)
        time.sleep(0.3)
        assert len(pids) == 4 and [p for p in pids if alive(p)] == [], pids

        # The kernel launches again, and its exceptions name the rank.
        out, err, error = run_cell(
            kc,
            """
print(lockstep.notebook_launcher(lambda: lockstep.comm().rank * 10, num_processes=3))
def bad():
    if lockstep.comm().rank == 2:
        raise KeyError("missing")
lockstep.notebook_launcher(bad, num_processes=3)
""",
        )
        assert "[0, 10, 20]" in out, out
        assert error is not None and error[0] == "RankError" and "rank 2 of 3 failed: KeyError" in error[1], error
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
