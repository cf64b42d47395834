"""torch's own distributed test suite (``torch.testing._internal.distributed.distributed_test``,
the suite behind torch's ``test/distributed/test_distributed_spawn.py``) on CPU, run in three
configurations one after the other, with a summary table at the end:

- ``gloo``: the suite as torch runs it for gloo (``BACKEND=gloo``), the reference;
- ``plugin``: ``BACKEND=lockstep``, the suite unmodified, as it runs for any plugin backend
  (tests written only for named backends skip);
- ``dropin``: lockstep as a drop-in for gloo: ``lockstep`` added to the suite's
  ``DistTestCases.backend_feature["plugin"]``, ``["ddp"]`` and ``["subgroup"]``, and its
  ``require_backend_is_available`` letting a test written for a set of backends that holds
  ``"gloo"`` run on lockstep too, and every comparison of the suite's ``BACKEND`` with "gloo"
  (``@skip_but_pass_in_sandcastle_if(BACKEND != "gloo", ...)``, ``if BACKEND == "gloo":`` in a
  test's body) reading it as gloo. The patch is applied here, to this process's copy of the
  module (its source is compiled with the changes), never to torch's files; what torch itself
  reports (``dist.get_backend()``) stays "lockstep".

Each configuration runs in its own runner process (unittest, one test at a time). Each test's
ranks are forked from the runner by default (torch's ``MultiProcessTestCase._start_processes``
with a fork context): ``--start spawn``, as ``test_distributed_spawn.py`` starts them, imports
torch and the suite again in every rank of every test, which makes a run many times longer.
torch's own per-test timeout
(``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``, set from ``--timeout``) ends a test whose ranks hang; a
runner that stops reporting for longer than that is killed, its current test recorded as an
error, and a new runner goes on with the next test. Per-test results are written as JSON lines
to ``--out`` (``<config>.jsonl``), which also lets an interrupted run resume (``--resume``).

    python python/benches/torch_suite.py [--configs gloo,plugin,dropin] [-k REGEX] [--timeout 180]
        [--world-size 2] [--start fork|spawn] [--out DIR] [--resume]

The table counts, per configuration: ran (every test unittest ran, skipped ones included),
skipped, passed, failed, errors; then the tests that failed or errored, and, for ``dropin``,
those gloo passed and lockstep did not.
"""

import argparse
import ast
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

CONFIGS = ("gloo", "plugin", "dropin")
# Set (with the configuration's name) in the runner's environment; the rank processes that torch
# spawns re-import this file and define the test class again only when it is set.
ENV = "LOCKSTEP_TORCH_SUITE"
SUITE = "torch.testing._internal.distributed.distributed_test"


def _as_gloo(require):
    """torch's ``require_backend_is_available`` for the drop-in configuration: a test written
    for backends that include gloo runs on ``BACKEND`` too."""

    def patched(backends):
        backend = os.environ["BACKEND"]
        if "gloo" in backends and backend not in backends:
            backends = set(backends) | {backend}
        return require(backends)

    return patched


def _names_gloo(node):
    """Whether `node` is the constant "gloo" or a list, tuple or set literal holding it."""
    if isinstance(node, ast.Constant):
        return node.value == "gloo"
    return isinstance(node, (ast.List, ast.Tuple, ast.Set)) and any(_names_gloo(e) for e in node.elts)


class _AsGloo(ast.NodeTransformer):
    """``BACKEND`` compared with "gloo" (``BACKEND != "gloo"``, ``BACKEND in ["gloo", ...]``)
    reads "gloo", in the tests' skip conditions and bodies alike: a test runs here as it runs for
    gloo. Comparisons that do not name gloo are left alone."""

    def visit_Compare(self, node):
        self.generic_visit(node)
        if isinstance(node.left, ast.Name) and node.left.id == "BACKEND" and any(_names_gloo(c) for c in node.comparators):
            node.left = ast.copy_location(ast.Constant("gloo"), node.left)
        return node


def _import_dropin():
    """Import torch's suite with lockstep as a drop-in for gloo (see the module docstring)."""
    import importlib.util

    from torch.testing._internal.common_distributed import DistTestCases

    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("lockstep")
    spec = importlib.util.find_spec(SUITE)
    with open(spec.origin) as f:
        tree = ast.parse(f.read(), spec.origin)
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.FunctionDef) and node.name == "require_backend_is_available":
            patch = ast.parse("require_backend_is_available = _lockstep_as_gloo(require_backend_is_available)").body
            for stmt in patch:
                ast.increment_lineno(stmt, node.end_lineno)
            tree.body[i + 1 : i + 1] = patch
            break
    else:
        raise RuntimeError(f"{spec.origin} has no require_backend_is_available: this torch's suite needs a new patch here")
    tree = _AsGloo().visit(tree)
    module = importlib.util.module_from_spec(spec)
    module._lockstep_as_gloo = _as_gloo
    sys.modules[SUITE] = module
    exec(compile(tree, spec.origin, "exec"), module.__dict__)
    return module


def _define_suite(config):
    """The test class of torch's test_distributed_spawn.py, for `config`."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    if config != "gloo":
        import lockstep.torch  # noqa: F401  (registers the backend)
    if config == "dropin":
        _import_dropin()
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    start = os.environ.get(ENV + "_START", "fork")

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            if start == "spawn":
                self._spawn_processes()
            else:
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"
    return TestDistBackendWithSpawn


if os.environ.get(ENV):
    TestDistBackendWithSpawn = _define_suite(os.environ[ENV])


# The runner (one configuration, in its own process) ---------------------------------------------


def _write(out, record):
    out.write(json.dumps(record) + "\n")
    out.flush()


def _run(path, pattern):
    """Run the suite's tests matching `pattern`, skipping those `path` already records, and
    append one JSON line per test to `path` ("start" before it, then its outcome)."""
    import unittest

    done = set()
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r["status"] != "start":
                    done.add(r["test"])
    cls = TestDistBackendWithSpawn
    names = [n for n in unittest.TestLoader().getTestCaseNames(cls) if re.search(pattern, n) and n not in done]

    with open(path, "a") as out:

        class Result(unittest.TestResult):
            def startTest(self, test):
                super().startTest(test)
                self._t0 = time.monotonic()
                _write(out, {"test": test._testMethodName, "status": "start"})

            def _end(self, test, status, detail=""):
                _write(out, {"test": test._testMethodName, "status": status, "seconds": round(time.monotonic() - self._t0, 2), "detail": detail[-4000:]})

            def addSuccess(self, test):
                super().addSuccess(test)
                self._end(test, "passed")

            def addSkip(self, test, reason):
                super().addSkip(test, reason)
                self._end(test, "skipped", reason)

            def addFailure(self, test, err):
                super().addFailure(test, err)
                self._end(test, "failed", self.failures[-1][1])

            def addError(self, test, err):
                super().addError(test, err)
                self._end(test, "error", self.errors[-1][1])

            def addExpectedFailure(self, test, err):
                super().addExpectedFailure(test, err)
                self._end(test, "passed", "expected failure")

            def addUnexpectedSuccess(self, test):
                super().addUnexpectedSuccess(test)
                self._end(test, "failed", "unexpected success")

        suite = unittest.TestSuite(cls(n) for n in names)
        suite.run(Result())


# The driver -------------------------------------------------------------------------------------


def _results(path):
    """{test: record} of the outcomes in `path`, and the test started last without an outcome."""
    results, started = {}, None
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r["status"] == "start":
                    started = r["test"]
                else:
                    results[r["test"]] = r
                    started = None
    return results, started


def _drive(config, args, path):
    """Run `config`'s runner until every matching test has an outcome; a runner that stops
    reporting is killed and its current test recorded as an error."""
    env = dict(os.environ)
    env.update(
        {
            ENV: config,
            ENV + "_START": args.start,
            "BACKEND": "gloo" if config == "gloo" else "lockstep",
            "WORLD_SIZE": str(args.world_size),
            "TEMP_DIR": tempfile.mkdtemp(prefix=f"torch-suite-{config}-"),
            "INIT_METHOD": "env://",
            "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(args.timeout),
            "PYTHONUNBUFFERED": "1",
        }
    )
    log = open(os.path.join(args.out, f"{config}.log"), "a")
    while True:
        before, _ = _results(path)
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--run", path, "-k", args.k],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        last, size = time.monotonic(), -1
        while proc.poll() is None:
            time.sleep(1)
            now = os.path.getsize(path) if os.path.exists(path) else 0
            if now != size:
                last, size = time.monotonic(), now
            elif time.monotonic() - last > args.timeout + 60:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
        after, started = _results(path)
        if started is None:
            if proc.returncode == 0:
                return after
            if len(after) == len(before):
                sys.exit(f"the {config} runner failed without running a test (exit {proc.returncode}); see {log.name}")
            continue
        with open(path, "a") as f:
            _write(f, {"test": started, "status": "error", "seconds": None, "detail": f"the runner stopped (exit {proc.returncode}) or stopped reporting for {args.timeout + 60} s during this test"})
        print(f"  {config}: {started} ended its runner; going on", flush=True)


def _reason(detail):
    """The line of a test's traceback that says what went wrong (its last exception line)."""
    lines = [ln.strip() for ln in detail.strip().splitlines()]
    said = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception|Failure)\b", ln)]
    return (said or lines or [""])[-1][:300]


def _summary(all_results, configs):
    rows = []
    for c in configs:
        rs = all_results[c].values()
        count = {s: sum(1 for r in rs if r["status"] == s) for s in ("skipped", "passed", "failed", "error")}
        rows.append((c, len(all_results[c]), count["skipped"], count["passed"], count["failed"], count["error"]))
    lines = ["| configuration | ran | skipped | passed | failed | errors |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {c} | {n} | {s} | {p} | {f} | {e} |" for c, n, s, p, f, e in rows]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    p.add_argument("-k", default="", help="run only the tests whose name matches this regular expression")
    p.add_argument("--timeout", type=int, default=180, help="seconds a test may take (torch's per-test timeout)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--start",
        choices=("fork", "spawn"),
        default="fork",
        help="how each test's two ranks start: fork (default: no re-import of torch) or spawn (as test_distributed_spawn.py; each rank imports torch and the suite again, many times slower)",
    )
    p.add_argument("--out", default=None, help="folder for the per-test results (default: a new temporary one)")
    p.add_argument("--resume", action="store_true", help="keep the results already in --out and run only the tests they lack")
    p.add_argument("--run", metavar="PATH", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        _run(args.run, args.k)
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configuration(s) {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    args.out = args.out or tempfile.mkdtemp(prefix="torch-suite-")
    os.makedirs(args.out, exist_ok=True)
    import torch

    print(f"torch {torch.__version__}, world size {args.world_size}, start {args.start}, results in {args.out}", flush=True)
    results = {}
    for c in configs:
        path = os.path.join(args.out, f"{c}.jsonl")
        if not args.resume and os.path.exists(path):
            os.unlink(path)
        t0 = time.monotonic()
        results[c] = _drive(c, args, path)
        print(f"{c}: {len(results[c])} tests in {time.monotonic() - t0:.0f} s", flush=True)
    print(f"\n{datetime.date.today()}, torch {torch.__version__}, world size {args.world_size}\n")
    print(_summary(results, configs))
    for c in configs:
        bad = sorted(t for t, r in results[c].items() if r["status"] in ("failed", "error"))
        if bad:
            print(f"\n{c}: failed or errors ({len(bad)}):")
            for t in bad:
                print(f"  {results[c][t]['status']:7} {t}: {_reason(results[c][t]['detail'])}")
    if "gloo" in results:
        for c in configs:
            if c == "gloo":
                continue
            lost = sorted(t for t, r in results["gloo"].items() if r["status"] == "passed" and results[c].get(t, {}).get("status") != "passed")
            if lost and c == "plugin":
                # Tests written for named backends skip there: expected, so counted only.
                how = sorted({results[c].get(t, {}).get("status", "not run") for t in lost})
                print(f"\npassed on gloo, not on plugin: {len(lost)} ({', '.join(how)})")
            elif lost:
                print(f"\npassed on gloo, not on {c} ({len(lost)}):")
                for t in lost:
                    print(f"  {results[c].get(t, {}).get('status', 'not run'):7} {t}")
            also = sorted(t for t in results[c] if results[c][t]["status"] in ("failed", "error") and results["gloo"].get(t, {}).get("status") in ("failed", "error"))
            if also:
                print(f"\n{c}: failing on gloo too ({len(also)}): {', '.join(also)}")


if __name__ == "__main__":
    main()
