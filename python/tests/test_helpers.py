"""Accelerate's rank helpers (lockstep.context()) across 3 ranks, numpy only."""

import os
import random

import numpy as np
import pytest

import lockstep
from conftest import launch


def _basics(path, order_file):
    ctx = lockstep.context()
    # main_process_first: rank 0 writes first, the others find its line already there.
    with ctx.main_process_first():
        with open(order_file, "a") as f:
            f.write(f"{ctx.rank}\n")
    lines = open(order_file).read().split()
    saved = ctx.save(b"payload from main", path)
    ctx.wait_for_everyone()
    return (ctx.rank, ctx.local_rank, ctx.world_size, ctx.is_main_process, ctx.is_local_main_process, lines, saved, open(path, "rb").read())


def test_identity_first_and_save(tmp_path):
    path, order = tmp_path / "model.bin", tmp_path / "order.txt"
    res = launch(3, _basics, str(path), str(order))
    assert [r[:5] for r in res] == [(0, 0, 3, True, True), (1, 1, 3, False, False), (2, 2, 3, False, False)]
    # When the block returns on any rank, every rank has run it, and rank 0 ran first.
    assert all(sorted(r[5]) == ["0", "1", "2"] and r[5][0] == "0" for r in res)
    assert [r[6] for r in res] == [True, False, False]
    assert all(r[7] == b"payload from main" for r in res)
    # No temporary file is left beside the saved one.
    assert sorted(os.listdir(tmp_path)) == ["model.bin", "order.txt"]


def _print():
    lockstep.context().print("only once", 42)


def test_print_on_main_only(capfd):
    launch(3, _print)
    out = capfd.readouterr().out
    assert out.count("only once 42") == 1, out


def _seed(seeds):
    ctx = lockstep.context()
    try:
        ctx.set_seed(seeds[ctx.rank])
    except ValueError as e:
        return ("error", str(e))
    return ("ok", random.random(), float(np.random.rand()))


def test_set_seed_moves_generators_and_is_checked():
    res = launch(3, _seed, [7, 7, 7])
    assert all(r[0] == "ok" for r in res)
    assert len({r[1:] for r in res}) == 1  # same draws on every rank
    random.seed(7)
    np.random.seed(7)
    assert res[0][1:] == (random.random(), float(np.random.rand()))
    res = launch(3, _seed, [7, 8, 7])
    assert all(r[0] == "error" and "[7, 8, 7]" in r[1] for r in res), res


def _reduce():
    ctx = lockstep.context()
    r = ctx.rank + 1
    arr = ctx.reduce(np.full(4, float(r), dtype=np.float32), "mean")
    return ctx.reduce(r), ctx.reduce(float(r) / 2, "mean"), ctx.reduce(r, "max"), arr.tolist()


def test_reduce_scalars_and_arrays():
    for got in launch(3, _reduce):
        assert got == (6, 1.0, 3, [2.0] * 4)


def _reduce_bad():
    ctx = lockstep.context()
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        ctx.reduce(1.0, "median")
    with pytest.raises(TypeError, match="bool"):
        ctx.reduce(True)
    return True


def test_reduce_refuses_nonsense_locally():
    assert launch(2, _reduce_bad) == [True, True]


def _metrics(dataset_len, batch):
    ctx = lockstep.context()
    world = ctx.world_size
    per_rank = -(-dataset_len // world)
    # The sampler's positions, wrapped to a multiple of the world: rank r takes r, r+world, ...
    shard = [((i * world + ctx.rank) % dataset_len) for i in range(per_rank)]
    got = []
    for first in range(0, per_rank, batch):
        local = np.array([[s, 10 * s] for s in shard[first : first + batch]], dtype=np.int64)
        got.append(ctx.gather_for_metrics(local, dataset_len, first))
    return np.concatenate(got).tolist()


@pytest.mark.parametrize("dataset_len", [7, 9, 10])
def test_gather_for_metrics_drops_padding(dataset_len):
    res = launch(3, _metrics, dataset_len, 2)
    want = [[s, 10 * s] for s in range(dataset_len)]
    assert all(r == want for r in res), res
