"""lockstep's diagnostics in Python's logging: LOCKSTEP_LOG=info prints each rank's init line on
stderr; without it the records still reach an application's logging configuration; an invalid
filter is an error naming the variable."""

import os
import re
import subprocess
import sys
import textwrap

import lockstep

LIMIT_S = 120

BODY = textwrap.dedent(
    """
    import logging, sys
    import lockstep
    {setup}
    def body():
        return lockstep.comm().rank
    print(lockstep.notebook_launcher(body, num_processes=2))
    """
)


def run(setup="", **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_LOG")}
    e.update(env)
    code = BODY.format(setup=setup)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=LIMIT_S, env=e, cwd="/tmp")


def init_line(rank):
    return f"lockstep.init: lockstep {lockstep.__version__} init: rank {rank} of 2"


def test_lockstep_log_info_prints_every_init_line():
    o = run(LOCKSTEP_LOG="info")
    assert o.returncode == 0, o.stderr
    assert "[0, 1]" in o.stdout, o.stdout
    for r in range(2):
        assert f"lockstep INFO {init_line(r)}" in o.stderr, o.stderr


def test_records_reach_the_applications_logging_without_lockstep_log():
    o = run(setup='logging.basicConfig(level=logging.INFO, format="%(name)s|%(levelname)s|%(message)s")')
    assert o.returncode == 0, o.stderr
    for r in range(2):
        want = f"lockstep.init|INFO|lockstep {lockstep.__version__} init: rank {r} of 2"
        assert want in o.stderr, o.stderr


def test_quiet_by_default():
    o = run()
    assert o.returncode == 0, o.stderr
    assert "init: rank" not in o.stderr, o.stderr


def test_timestamps_on_request():
    o = run(LOCKSTEP_LOG="info", LOCKSTEP_LOG_TIME="1")
    assert o.returncode == 0, o.stderr
    stamped = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ lockstep INFO " + re.escape(init_line(0))
    assert re.search(stamped, o.stderr), o.stderr


def test_invalid_filter_is_an_error_naming_it():
    o = run(LOCKSTEP_LOG="lockstep=loud")
    assert o.returncode != 0, o
    assert 'LOCKSTEP_LOG="lockstep=loud" is not a log filter' in o.stderr, o.stderr
