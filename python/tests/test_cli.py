"""The ``lockstep`` command as the wheel installs it: the console script beside this Python, and
``python -m lockstep``, running the Rust command in-process (``lockstep._native.cli_main``)."""

import os
import shutil
import subprocess
import sys

import pytest

import lockstep

# Every job here is small; a hang fails the test instead of the run.
LIMIT_S = 120


def script():
    """The console script pip installed next to this interpreter."""
    path = shutil.which("lockstep", path=os.path.dirname(sys.executable))
    assert path, f"no `lockstep` console script beside {sys.executable}: the package must install one ([project.scripts])"
    return path


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=LIMIT_S, **kw)


def test_version_matches_package():
    o = run([script(), "--version"])
    assert o.returncode == 0, o
    assert o.stdout.split() == ["lockstep", lockstep.__version__], o.stdout


def test_python_m_lockstep_is_the_same_command():
    o = run([sys.executable, "-m", "lockstep", "--version"])
    assert o.returncode == 0, o
    assert o.stdout.split() == ["lockstep", lockstep.__version__], o.stdout


def test_env_reports_libraries():
    o = run([script(), "env"])
    assert o.returncode == 0, o
    for want in ("driver", "nccl"):
        assert want in o.stdout, o.stdout


def test_launch_runs_python_ranks():
    code = "import lockstep, os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"
    o = run([script(), "launch", "--nproc-per-node", "2", sys.executable, "-c", code])
    assert o.returncode == 0, o
    out = o.stdout
    assert "rank 0 of 2" in out and "rank 1 of 2" in out, out


def test_launch_exit_status_is_the_ranks():
    o = run([script(), "launch", "--nproc-per-node", "2", sys.executable, "-c", "import sys, os; sys.exit(3 if os.environ['RANK'] == '1' else 0)"])
    assert o.returncode == 3, o
    assert "rank 1" in o.stderr, o.stderr


def test_usage_error_exits_2_with_a_tip():
    o = run([script(), "launch", "--nproc-per-nod", "2", "true"])
    assert o.returncode == 2, o
    assert "--nproc-per-node" in o.stderr, o.stderr


def test_bench_verifies_results():
    o = run([script(), "bench", "--nprocs", "2", "--sizes", "8,65536", "-n", "3", "-w", "1", "--format", "json"])
    assert o.returncode == 0, o
    import json

    v = json.loads(o.stdout)
    assert v["wrong"] == 0 and len(v["rows"]) == 2, v


@pytest.mark.parametrize("var,value", [("LOCKSTEP_LOG", "lockstep=loud"), ("LOCKSTEP_LOG_TIME", "maybe")])
def test_bad_log_variables_are_refused(var, value):
    o = run([script(), "env"], env={**os.environ, var: value})
    assert o.returncode == 2, o
    assert f"{var}={value!r}".replace("'", '"') in o.stderr, o.stderr
