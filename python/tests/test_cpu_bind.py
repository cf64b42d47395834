"""Embedded in Python, lockstep binds no CPU unless asked: a rank's affinity (and that of threads
it starts) after joining is what it was before; LOCKSTEP_CPU_BIND=core or block binds."""

import os
import subprocess
import sys
import textwrap

LIMIT_S = 120

CODE = textwrap.dedent(
    """
    import os, threading
    import lockstep
    def body():
        lockstep.comm()
        seen = []
        t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
        t.start(); t.join()
        return sorted(os.sched_getaffinity(0)), seen[0]
    print(repr((sorted(os.sched_getaffinity(0)), lockstep.notebook_launcher(body, num_processes={n}))))
    """
)


def run(n, bind=None):
    env = {k: v for k, v in os.environ.items() if k != "LOCKSTEP_CPU_BIND"}
    if bind is not None:
        env["LOCKSTEP_CPU_BIND"] = bind
    o = subprocess.run([sys.executable, "-c", CODE.format(n=n)], capture_output=True, text=True, timeout=LIMIT_S, env=env, cwd="/tmp")
    assert o.returncode == 0, o.stderr
    return eval(o.stdout.strip().splitlines()[-1])


def test_nothing_is_bound_by_default():
    before, ranks = run(1)
    assert ranks == [(before, before)], (before, ranks)


def test_core_and_block_bind_when_asked():
    allowed = sorted(os.sched_getaffinity(0))
    n = 2 if len(allowed) >= 2 else 1
    _, ranks = run(n, "core")
    assert [r[0] for r in ranks] == [[allowed[r]] for r in range(n)], ranks
    _, ranks = run(n, "block")
    per = len(allowed) // n
    assert [r[0] for r in ranks] == [allowed[r * per : (r + 1) * per] for r in range(n)], ranks
    assert all(mine == thread for mine, thread in ranks), ranks
