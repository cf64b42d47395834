"""The Python surface of going on after a failure and looking inside a job: the flight recorder
(`Communicator.trace`, `dump_trace`), `Communicator.shrink`, and `lockstep.status`."""

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

import lockstep
from conftest import launch


def test_trace_records_the_calls_and_dumps_them(tmp_path):
    def body(d):
        c = lockstep.comm()
        for _ in range(3):
            c.all_reduce(np.ones(4, np.float32))
        c.broadcast(np.ones(2), root=1)
        recs = c.trace()
        path = c.dump_trace(d)
        return [(r["seq"], r["op"], r["count"], r["state"]) for r in recs], path

    out = launch(2, body, str(tmp_path))
    for rank, (recs, path) in enumerate(out):
        assert recs[-4:] == [(1, "all_reduce", 4, "ok"), (2, "all_reduce", 4, "ok"), (3, "all_reduce", 4, "ok"), (4, "broadcast", 2, "ok")], recs
        assert os.path.dirname(path) == str(tmp_path), path
        with open(path) as f:
            lines = [json.loads(line) for line in f]
        assert lines[0]["rank"] == rank and lines[0]["world"] == 2, lines[0]
        assert [r["op"] for r in lines[1:]][-4:] == ["all_reduce"] * 3 + ["broadcast"], lines


def test_shrink_leaves_out_a_rank_that_does_not_come():
    def body():
        c = lockstep.comm()
        c.all_reduce(np.ones(1))
        if c.rank == 2:
            time.sleep(2.0)
            try:
                c.all_reduce(np.ones(1))
                return "no error"
            except lockstep.CommError as e:
                return e.kind
        # Rank 2 may still be finishing the all-reduce above when ranks 0 and 1 leave it, and a
        # shrink aborts the calls in flight: let it reach its sleep first.
        time.sleep(0.3)
        s = c.shrink(exclude=[2], wait=0.5)
        x = np.full(3, float(s.rank + 1))
        s.all_reduce(x)
        try:
            c.all_reduce(np.ones(1))
            old = "no error"
        except lockstep.CommError as e:
            old = e.kind
        return s.rank, s.world_size, x.tolist(), old

    r0, r1, r2 = launch(3, body)
    assert r0 == (0, 2, [3.0, 3.0, 3.0], "shrunk"), r0
    assert r1 == (1, 2, [3.0, 3.0, 3.0], "shrunk"), r1
    assert r2 == "excluded", r2


def test_status_lists_the_running_job():
    def body():
        c = lockstep.comm()
        c.barrier()
        if c.rank == 0:
            jobs = lockstep.status()["jobs"]
            # The forked job of this launch (with torch loaded, the ranks' process group is a
            # second, exec-style job of the same ranks).
            mine = [j for j in jobs if os.getpid() in j["rank_pids"] and j["forked"]]
            st = lockstep.status(mine[0]["id"]) if mine else None
        c.barrier()
        if c.rank == 0:
            return mine, [r["rank"] for r in st["ranks"]], st["job"]["world"]
        return None

    mine, ranks, world = launch(2, body)[0]
    assert (len(mine), ranks, world) == (1, [0, 1], 2), mine


_GROW_RANK = r"""
import json, os, sys
import numpy as np
import lockstep

out = sys.argv[1]
c = lockstep.init_from_env()
replacement = os.environ.get("LOCKSTEP_REPLACEMENT") == "1"
if c.rank == 1 and not replacement:
    os._exit(9)  # the first rank 1 dies; the launcher starts its replacement
if not replacement:
    try:
        c.all_reduce(np.ones(1))
        sys.exit("the all-reduce with a dead rank succeeded")
    except lockstep.CommError as e:
        lost = e.kind
    c = c.grow(wait=60.0)
else:
    lost = "-"
x = np.full(4, float(c.rank + 1))
c.all_reduce(x)
with open(os.path.join(out, f"rank{c.rank}-{int(replacement)}.json"), "w") as f:
    json.dump({"rank": c.rank, "world": c.world_size, "sum": x.tolist(), "lost": lost}, f)
"""


def test_grow_takes_the_replacement_back_in(tmp_path):
    """Under `lockstep launch --restart-policy rank`, the survivor of a lost rank grows with the
    replacement the launcher starts: same ranks, and the collectives after it add both."""
    cli = shutil.which("lockstep", path=os.path.dirname(sys.executable))
    assert cli, f"no `lockstep` console script beside {sys.executable}"
    script = tmp_path / "rank.py"
    script.write_text(_GROW_RANK)
    o = subprocess.run(
        [cli, "launch", "--nproc-per-node", "2", "--max-restarts", "1", "--restart-policy", "rank",
         sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert o.returncode == 0, (o.stdout, o.stderr)
    r0 = json.loads((tmp_path / "rank0-0.json").read_text())
    r1 = json.loads((tmp_path / "rank1-1.json").read_text())
    assert r0 == {"rank": 0, "world": 2, "sum": [3.0] * 4, "lost": "peer_lost"}, r0
    assert r1 == {"rank": 1, "world": 2, "sum": [3.0] * 4, "lost": "-"}, r1


_STUCK_JOB = r"""
import time
import numpy as np
import lockstep

def body():
    c = lockstep.comm()
    c.timeout = 1.0
    for _ in range(40):
        c.all_reduce(np.ones(256, np.float32))
    if c.rank == 2:
        time.sleep(60)  # computing, in no call: it skips the 41st all-reduce
    c.all_reduce(np.ones(256, np.float32))

try:
    lockstep.notebook_launcher(body, num_processes=3)
except lockstep.RankError as e:
    print("failed:", e.rank)
"""


def test_a_failed_job_leaves_every_ranks_trace(tmp_path):
    """LOCKSTEP_TRACE_DIR (not made yet): ranks 0 and 1 time out in all-reduce #41 while rank 2
    computes. Ranks 0 and 1 write their records on the timeout; the launcher asks rank 2 for its
    record before it stops it, without waiting out its computation; `lockstep trace` then names
    rank 2 as the rank that never arrived at #41."""
    d = tmp_path / "traces"
    t0 = time.monotonic()
    o = subprocess.run([sys.executable, "-c", _STUCK_JOB], capture_output=True, text=True, timeout=120, env={**os.environ, "LOCKSTEP_TRACE_DIR": str(d)})
    took = time.monotonic() - t0
    assert "failed:" in o.stdout and took < 30, (took, o.stdout, o.stderr)
    # Every file whole, and no write's temporary left behind by a rank stopped while it wrote.
    assert sorted(os.listdir(d)) == ["rank00000.jsonl", "rank00001.jsonl", "rank00002.jsonl"], (os.listdir(d), o.stderr)
    r = subprocess.run([sys.executable, "-m", "lockstep", "trace", "--json", str(d)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    comm = json.loads(r.stdout)["comms"][0]
    assert comm["stuck"]["seq"] == 41 and comm["stuck"]["stuck"] == [0, 1] and comm["stuck"]["missing"] == [2], comm
