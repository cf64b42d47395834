"""Every collective on numpy arrays, checked against numpy references, world sizes 1 to 3."""

import array

import numpy as np
import pytest

import lockstep
from conftest import launch

WORLDS = [1, 2, 3]
DTYPES = [np.float32, np.float64, np.float16, np.int8, np.int32, np.int64, np.uint8, np.uint32, np.uint64]
OPS = ["sum", "prod", "min", "max", "avg"]


def data(rank, n, dtype, salt=0):
    """Rank `rank`'s input: small non-negative integers, exact in every dtype (and in products
    of up to three ranks)."""
    rng = np.random.default_rng(1000 * salt + rank)
    return rng.integers(1, 5, size=n).astype(dtype)


def reference(op, xs, dtype):
    stack = np.stack(xs)
    if op == "sum":
        return stack.sum(axis=0, dtype=dtype)
    if op == "prod":
        return stack.prod(axis=0, dtype=dtype)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    total = stack.sum(axis=0, dtype=np.float64)
    if np.issubdtype(dtype, np.integer):
        return (stack.sum(axis=0, dtype=np.int64) // len(xs)).astype(dtype)
    return (total / len(xs)).astype(dtype)


def check(got, want, dtype):
    assert got.dtype == want.dtype
    if dtype == np.float16:
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3)
    elif np.issubdtype(dtype, np.floating):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_every_dtype_and_op(world):
    n = 37

    def body():
        c = lockstep.comm()
        out = {}
        for dt in DTYPES:
            for op in OPS:
                x = data(c.rank, n, dt)
                y = np.zeros_like(x)
                assert c.all_reduce(x, y, op=op) is y
                z = data(c.rank, n, dt)
                c.all_reduce(z, op=op)  # recv=None: in place
                w = data(c.rank, n, dt)
                c.all_reduce_in_place(w, op)
                assert np.array_equal(y, z) and np.array_equal(z, w), (dt, op)
                assert np.array_equal(x, data(c.rank, n, dt)), "out of place must not touch send"
                out[(np.dtype(dt).name, op)] = y
        return out

    results = launch(world, body)
    for dt in DTYPES:
        for op in OPS:
            want = reference(op, [data(r, n, dt) for r in range(world)], dt)
            for r in range(world):
                check(results[r][(np.dtype(dt).name, op)], want, dt)


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast(world):
    def body():
        c = lockstep.comm()
        out = []
        for root in range(c.world_size):
            x = data(c.rank, 10, np.float64, salt=root)
            y = np.full(10, -1.0)
            c.broadcast(x, y, root=root)
            c.broadcast_in_place(x, root=root)
            b = data(c.rank, 10, np.float64, salt=root)
            c.broadcast(b, root=root)
            out.append((y, x, b))
        return out

    for r, res in enumerate(launch(world, body)):
        for root, (y, x, b) in enumerate(res):
            want = data(root, 10, np.float64, salt=root)
            for got in (y, x, b):
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("world", WORLDS)
def test_reduce(world):
    def body():
        c = lockstep.comm()
        out = []
        for root in range(c.world_size):
            x = data(c.rank, 8, np.int64, salt=root)
            y = np.zeros(8, np.int64) if c.rank == root else None
            got = c.reduce(x, y, op="max", root=root)
            assert (got is y) if c.rank == root else got is None
            z = data(c.rank, 8, np.int64, salt=root)
            c.reduce_in_place(z, op="sum", root=root)
            out.append((y, z))
        return out

    for r, res in enumerate(launch(world, body)):
        for root, (y, z) in enumerate(res):
            xs = [data(q, 8, np.int64, salt=root) for q in range(world)]
            if r == root:
                np.testing.assert_array_equal(y, np.max(xs, axis=0))
                np.testing.assert_array_equal(z, np.sum(xs, axis=0))
            else:
                assert y is None
                np.testing.assert_array_equal(z, xs[r])  # untouched off the root


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather(world):
    def body():
        c = lockstep.comm()
        x = data(c.rank, 5, np.uint32)
        y = np.zeros(5 * c.world_size, np.uint32)
        c.all_gather(x, y)
        buf = np.zeros((c.world_size, 5), np.uint32)  # 2-D, C order: row r is rank r's block
        buf[c.rank] = x
        c.all_gather(buf)
        return y, buf

    want = np.concatenate([data(r, 5, np.uint32) for r in range(world)])
    for y, buf in launch(world, body):
        np.testing.assert_array_equal(y, want)
        np.testing.assert_array_equal(buf.reshape(-1), want)


@pytest.mark.parametrize("world", WORLDS)
def test_gather(world):
    def body():
        c = lockstep.comm()
        out = []
        for root in range(c.world_size):
            x = data(c.rank, 4, np.float32, salt=root)
            y = np.zeros(4 * c.world_size, np.float32) if c.rank == root else None
            out.append(c.gather(x, y, root=root))
        return out

    for r, res in enumerate(launch(world, body)):
        for root, got in enumerate(res):
            if r == root:
                np.testing.assert_array_equal(got, np.concatenate([data(q, 4, np.float32, salt=root) for q in range(world)]))
            else:
                assert got is None


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter(world):
    def body():
        c = lockstep.comm()
        x = data(c.rank, 6 * c.world_size, np.int32)
        y = np.zeros(6, np.int32)
        c.reduce_scatter(x, y, op="sum")
        z = data(c.rank, 6 * c.world_size, np.int32)
        c.reduce_scatter(z, op="min")  # in place: block `rank` of z
        return y, z

    xs = [data(r, 6 * world, np.int32) for r in range(world)]
    for r, (y, z) in enumerate(launch(world, body)):
        np.testing.assert_array_equal(y, np.sum(xs, axis=0)[6 * r : 6 * (r + 1)])
        np.testing.assert_array_equal(z[6 * r : 6 * (r + 1)], np.min(xs, axis=0)[6 * r : 6 * (r + 1)])


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all(world):
    def body():
        c = lockstep.comm()
        x = (np.arange(3 * c.world_size) + 100 * c.rank).astype(np.int64)
        y = np.zeros_like(x)
        return c.all_to_all(x, y)

    for r, y in enumerate(launch(world, body)):
        want = np.concatenate([(np.arange(3 * world) + 100 * q)[3 * r : 3 * (r + 1)] for q in range(world)])
        np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all_v(world):
    # Rank i sends i + j + 1 elements to rank j, valued 1000*i + 10*j + k.
    def body():
        c = lockstep.comm()
        i, n = c.rank, c.world_size
        send_counts = [i + j + 1 for j in range(n)]
        recv_counts = [q + i + 1 for q in range(n)]
        send = np.concatenate([1000 * i + 10 * j + np.arange(send_counts[j]) for j in range(n)]).astype(np.float64)
        recv = np.zeros(sum(recv_counts))
        c.all_to_all_v(send, send_counts, recv, recv_counts)
        # Explicit displacements: received blocks in reverse order with one gap slot each.
        recv2 = np.full(sum(recv_counts) + n, -1.0)
        displs, at = [0] * n, 0
        for q in reversed(range(n)):
            displs[q] = at
            at += recv_counts[q] + 1
        c.all_to_all_v(send, send_counts, recv2, recv_counts, recv_displs=displs)
        return recv, recv2, displs

    for i, (recv, recv2, displs) in enumerate(launch(world, body)):
        blocks = [1000 * q + 10 * i + np.arange(q + i + 1) for q in range(world)]
        np.testing.assert_array_equal(recv, np.concatenate(blocks))
        for q in range(world):
            np.testing.assert_array_equal(recv2[displs[q] : displs[q] + len(blocks[q])], blocks[q])


@pytest.mark.parametrize("world", WORLDS)
def test_scatter(world):
    def body():
        c = lockstep.comm()
        out = []
        for root in range(c.world_size):
            send = (np.arange(4 * c.world_size) + 7 * root).astype(np.uint8) if c.rank == root else None
            recv = np.zeros(4, np.uint8)
            out.append(c.scatter(send, recv, root=root))
        return out

    for r, res in enumerate(launch(world, body)):
        for root, got in enumerate(res):
            np.testing.assert_array_equal(got, (np.arange(4 * world) + 7 * root)[4 * r : 4 * (r + 1)].astype(np.uint8))


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_v_and_gather_v(world):
    def body():
        c = lockstep.comm()
        counts = [r + 2 for r in range(c.world_size)]
        x = data(c.rank, counts[c.rank], np.int8)
        y = np.zeros(sum(counts), np.int8)
        c.all_gather_v(x, y, counts)
        out = [y]
        for root in range(c.world_size):
            if c.rank == root:
                g = np.zeros(sum(counts), np.int8)
                out.append(c.gather_v(x, g, counts, root=root))
            else:
                out.append(c.gather_v(x, root=root))
        return out

    want = np.concatenate([data(r, r + 2, np.int8) for r in range(world)])
    for r, (y, *gs) in enumerate(launch(world, body)):
        np.testing.assert_array_equal(y, want)
        for root, g in enumerate(gs):
            if r == root:
                np.testing.assert_array_equal(g, want)
            else:
                assert g is None


@pytest.mark.parametrize("world", [2, 3])
def test_send_recv_and_group(world):
    def body():
        c = lockstep.comm()
        i, n = c.rank, c.world_size
        # Blocking pairs: rank 0 sends to every other rank, which answers.
        got = []
        if i == 0:
            for p in range(1, n):
                c.send(np.full(3, 10.0 + p, np.float32), p)
                got.append(c.recv(np.zeros(3, np.float32), p))
        else:
            m = c.recv(np.zeros(3, np.float32), 0)
            c.send(m * 2, 0)
        # A ring in one group: everyone sends right and receives from the left.
        ring = np.zeros(4, np.int64)
        c.group([("send", np.full(4, i, np.int64), (i + 1) % n), ("recv", ring, (i - 1) % n)])
        return got, ring

    res = launch(world, body)
    for p, g in enumerate(res[0][0], start=1):
        np.testing.assert_array_equal(g, np.full(3, 2 * (10.0 + p), np.float32))
    for i, (_, ring) in enumerate(res):
        np.testing.assert_array_equal(ring, np.full(4, (i - 1) % world))


def test_recv_any_returns_the_sender():
    def body():
        c = lockstep.comm()
        i, n = c.rank, c.world_size
        got = []
        if i == 0:
            for _ in range(2 * (n - 1)):
                b = np.zeros(3, np.int64)
                got.append((c.recv_any(b), b.tolist()))
        else:
            for m in range(2):
                c.send(np.full(3, 10 * i + m, np.int64), 0)
        c.barrier()
        # In a group where everyone sends first: rank 0 sends to each rank and takes their
        # answers from any source (peer None); group returns each op's peer, senders filled in.
        if i == 0:
            ins = [np.zeros(2, np.float32) for _ in range(n - 1)]
            ops = [("send", np.full(2, p, np.float32), p) for p in range(1, n)]
            peers = c.group(ops + [("recv", b, None) for b in ins])
            got.append((peers, [b.tolist() for b in ins]))
        else:
            back = np.zeros(2, np.float32)
            c.group([("send", np.full(2, 100 + i, np.float32), 0), ("recv", back, 0)])
        return got

    n = 3
    got = launch(n, body)[0]
    plain, (peers, ins) = got[:-1], got[-1]
    assert sorted(src for src, _ in plain) == [1, 1, 2, 2], plain
    for q in range(1, n):
        assert [b for src, b in plain if src == q] == [[10 * q] * 3, [10 * q + 1] * 3], plain
    froms = peers[n - 1 :]
    assert peers[: n - 1] == list(range(1, n)) and sorted(froms) == list(range(1, n)), peers
    assert all(b == [100.0 + f] * 2 for f, b in zip(froms, ins)), (froms, ins)


def test_recv_any_alone_is_refused():
    def body():
        c = lockstep.comm()
        with pytest.raises(lockstep.CommError, match="one rank only"):
            c.recv_any(np.zeros(2))
        return True

    assert launch(1, body) == [True]


def test_group_send_to_self_and_barrier():
    def body():
        c = lockstep.comm()
        r = np.zeros(2)
        c.group([("send", np.array([1.5, 2.5]), c.rank), ("recv", r, c.rank)])
        for _ in range(10):
            c.barrier()
        return r, c.seq

    for r, seq in launch(1, body):
        np.testing.assert_array_equal(r, [1.5, 2.5])
        assert seq >= 10


@pytest.mark.parametrize("world", [2])
def test_other_buffer_types(world):
    def body():
        c = lockstep.comm()
        b = bytearray([c.rank + 1] * 6)
        c.all_reduce(b)  # format 'B': uint8
        a = array.array("d", [c.rank + 0.5] * 3)
        c.all_reduce(a, op="max")
        m = memoryview(bytearray(16)).cast("i")  # int32 through a memoryview
        m[:] = array.array("i", [c.rank] * 4)
        c.all_reduce(m)
        ro = bytes([c.rank] * 4)  # read-only send, out of place
        out = bytearray(4)
        c.all_reduce(ro, out, op="max")
        return bytes(b), list(a), m.tolist(), bytes(out)

    for b, a, m, out in launch(world, body):
        assert b == bytes([3] * 6)
        assert a == [1.5] * 3
        assert m == [1] * 4
        assert out == bytes([1] * 4)


def test_properties_and_repr():
    def body():
        c = lockstep.comm()
        return c.rank, c.world_size, c.backend, repr(c), lockstep.init_from_env() is c

    res = launch(3, body)
    for r, (rank, world, backend, text, same) in enumerate(res):
        assert (rank, world, backend, same) == (r, 3, "shm", True)
        assert text == f"<lockstep.Communicator rank {r} of 3 (shm)>"


def test_gil_is_released_during_a_collective():
    """While rank 0 waits in a collective for a late peer, another thread of rank 0 keeps running
    Python code (it could not if the wait held the GIL)."""

    def body():
        import threading
        import time

        c = lockstep.comm()
        ticks = [0]
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                ticks[0] += 1

        if c.rank == 1:
            time.sleep(0.5)
            c.barrier()
            return None
        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.05)
        before = ticks[0]
        t0 = time.monotonic()
        c.barrier()
        waited = time.monotonic() - t0
        during = ticks[0] - before
        stop.set()
        t.join()
        return waited, during

    (waited, during), _ = launch(2, body)
    assert waited > 0.3
    assert during > 10_000, f"the spinning thread made {during} steps while rank 0 waited {waited:.2f} s"


class DLPackOnly:
    """An object offering only DLPack (as torch tensors do), here over a numpy array."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


@pytest.mark.parametrize("world", [2])
def test_dlpack_objects(world):
    def body():
        c = lockstep.comm()
        x = np.full((2, 3), c.rank + 1, np.int32)
        assert c.all_reduce(DLPackOnly(x)).a is x  # in place through DLPack
        y = np.zeros(2 * c.world_size, np.float16)
        c.all_gather(DLPackOnly(np.full(2, c.rank + 0.5, np.float16)), DLPackOnly(y))
        with pytest.raises(ValueError, match="not C-contiguous"):
            c.all_reduce(DLPackOnly(np.ones(8, np.float32)[::2]))
        c.barrier()  # both ranks refused the same call: still in step
        return x, y

    for x, y in launch(world, body):
        np.testing.assert_array_equal(x, np.full((2, 3), 3, np.int32))
        np.testing.assert_array_equal(y, np.array([0.5, 0.5, 1.5, 1.5], np.float16))


def test_shared_memory_is_zeroed_reduced_in_place_and_freed(monkeypatch):
    """alloc_shared: numpy views of memory in the segment (zero-copy collectives); each block
    goes back to the heap when its last view is gone (6 x 3 MiB pass through an 8 MiB heap)."""
    monkeypatch.setenv("LOCKSTEP_SHM_HEAP_BYTES", str(8 << 20))

    def body():
        c = lockstep.comm()
        out = []
        for i in range(6):
            mem = c.alloc_shared(3 << 20)
            a = np.asarray(mem).view(np.float32)
            assert mem.nbytes == 3 << 20 and a.size == (3 << 20) // 4 and not a.any()
            a[:] = c.rank + i
            c.all_reduce(a)
            out.append((float(a[0]), float(a[-1])))
            del mem, a
        with pytest.raises(lockstep.CommError, match="shared heap"):
            c.alloc_shared(16 << 20)
        return out

    for out in launch(2, body):
        assert out == [(1.0 + 2 * i, 1.0 + 2 * i) for i in range(6)]
