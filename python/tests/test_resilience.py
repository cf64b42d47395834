"""The Python surface of going on after a failure and looking inside a job: the flight recorder
(`Communicator.trace`, `dump_trace`), `Communicator.shrink`, and `lockstep.status`."""

import json
import os
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
