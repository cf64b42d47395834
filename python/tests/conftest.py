"""Shared helpers: launching ranks and checking that nothing is left behind."""

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import lockstep


def require_or_skip(what, hint):
    """Skip the calling test module because `what` is not installed, printing "skipped: {what}
    not installed"; fail instead when LOCKSTEP_REQUIRE_TORCH=1 (a run that must exercise the
    torch tests, e.g. in a virtual environment that has torch)."""
    if os.environ.get("LOCKSTEP_REQUIRE_TORCH") == "1":
        pytest.fail(f"LOCKSTEP_REQUIRE_TORCH=1 but {what} is not installed ({hint})", pytrace=False)
    pytest.skip(f"skipped: {what} not installed", allow_module_level=True)


def children():
    """Pids of this process's live or zombie children (from /proc, every thread)."""
    out = set()
    for f in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(f) as fh:
                out.update(int(p) for p in fh.read().split())
        except OSError:
            pass
    return out


def alive(pid):
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _foreign(path):
    """Whether segment `path` belongs to another run on this machine: its job id has the
    launchers' format (``lockstep-<launcher pid>-<time>``, both hex) and names a live process that
    is neither this test process nor one of its descendants. Anything else counts as ours."""
    m = re.match(r"lockstep-([0-9a-f]+)-", os.path.basename(path))
    if not m:
        return False
    pid, me = int(m.group(1), 16), os.getpid()
    p = pid
    for _ in range(64):
        if p == me:
            return False
        try:
            with open(f"/proc/{p}/stat") as f:
                q = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return p != pid  # the launcher itself is gone: ours if it was
        if q <= 1:
            return True
        p = q
    return True


def shm_entries():
    """lockstep's names in /dev/shm (other runs' segments aside, see ``_foreign``)."""
    return {p for p in glob.glob("/dev/shm/*") if "lockstep" in os.path.basename(p) and not _foreign(p)}


def open_fds():
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def no_leftovers():
    """Fail the test if it leaves a child process, a /dev/shm segment or a descriptor behind."""
    shm0, fds0 = shm_entries(), open_fds()
    yield
    assert children() == set(), "a rank process (or one it started) is still there"
    assert shm_entries() - shm0 == set(), "a lockstep segment was left in /dev/shm"
    assert open_fds() - fds0 == set(), "the launcher leaked file descriptors"


def launch(world, fn, *args):
    return lockstep.notebook_launcher(fn, args, num_processes=world)


SIM_CUDA = Path(__file__).resolve().parents[2] / "tests" / "fake" / "sim_cuda.c"
SIM_NCCL = SIM_CUDA.with_name("sim_nccl.c")


@pytest.fixture(scope="session")
def fake_cuda(tmp_path_factory):
    """The simulated CUDA driver of the Rust tests (device memory is host memory, copies are
    memcpy), compiled as libcuda.so.1."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        if os.environ.get("LOCKSTEP_REQUIRE_CC") == "1":
            pytest.fail("LOCKSTEP_REQUIRE_CC=1 but there is no C compiler (cc) to build the fake CUDA driver")
        pytest.skip("skipped: no C compiler (cc) to build the fake CUDA driver")
    if not SIM_CUDA.exists():
        pytest.skip(f"skipped: {SIM_CUDA} not found (run from a lockstep checkout)")
    out = tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(SIM_CUDA)], check=True)
    return out


@pytest.fixture(scope="session")
def fake_nccl(fake_cuda):
    """The simulated NCCL of the Rust tests (collectives copy send to receive), compiled as
    libnccl.so.2 beside the simulated driver."""
    out = fake_cuda.with_name("libnccl.so.2")
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-o", str(out), str(SIM_NCCL)], check=True)
    return out
