"""Wrong buffers raise TypeError/ValueError on the calling rank, and the peers' matching call fails
with lockstep.CommError instead of hanging; mismatches raise CommError naming the ranks."""

import numpy as np
import pytest

import lockstep
from conftest import launch


def one_rank_refused(bad, exc):
    """Rank 0 makes the call `bad(c)` that must raise `exc`; rank 1 makes a valid all-reduce at the
    same point, which must fail with CommError; then both make a valid call that must succeed."""

    def body():
        c = lockstep.comm()
        if c.rank == 0:
            with pytest.raises(exc) as e:
                bad(c)
        else:
            with pytest.raises(lockstep.CommError) as e:
                c.all_reduce(np.ones(4, np.float32))
        x = np.ones(3)
        c.all_reduce(x)
        return str(e.value), x.tolist()

    (m0, x0), (m1, x1) = launch(2, body)
    assert x0 == x1 == [2.0, 2.0, 2.0], "the ranks must be back in step after the refused call"
    assert "rank 0" in m1, m1
    return m0, m1


def test_not_a_buffer():
    m0, _ = one_rank_refused(lambda c: c.all_reduce([1.0, 2.0]), TypeError)
    assert "list" in m0 and "buffer protocol" in m0


def test_non_contiguous():
    m0, _ = one_rank_refused(lambda c: c.all_reduce(np.ones(8, np.float32)[::2]), ValueError)
    assert "not C-contiguous" in m0 and "ascontiguousarray" in m0


def test_fortran_order_is_refused():
    m0, _ = one_rank_refused(lambda c: c.all_reduce(np.ones((3, 4), np.float32, order="F")), ValueError)
    assert "not C-contiguous" in m0


@pytest.mark.parametrize(
    "arr, word",
    [
        (np.ones(4, np.bool_), '"?"'),
        (np.ones(4, np.int16), "16-bit"),
        (np.ones(4, np.complex64), "Zf"),
        (np.ones(4, np.dtype(">f4")), "byte order"),
    ],
)
def test_unsupported_element_types(arr, word):
    m0, _ = one_rank_refused(lambda c: c.all_reduce(arr), TypeError)
    assert word in m0, m0


def test_read_only_result():
    def bad(c):
        a = np.ones(4, np.float32)
        a.setflags(write=False)
        c.all_reduce(a)

    m0, _ = one_rank_refused(bad, ValueError)
    assert "read-only" in m0


def test_dtype_disagreement_between_send_and_recv():
    m0, _ = one_rank_refused(lambda c: c.all_reduce(np.ones(4, np.float32), np.ones(4, np.float64)), TypeError)
    assert "float32" in m0 or "f32" in m0


def test_overlapping_send_and_recv():
    def bad(c):
        a = np.ones(8, np.float32)
        c.all_reduce(a[:4], a[2:6])

    m0, _ = one_rank_refused(bad, ValueError)
    assert "share memory" in m0


def test_misaligned():
    def bad(c):
        a = np.frombuffer(bytearray(20), dtype=np.float32, offset=1, count=4)
        c.all_reduce(a, np.zeros(4, np.float32))

    m0, _ = one_rank_refused(bad, ValueError)
    assert "aligned" in m0


def test_unknown_op():
    m0, _ = one_rank_refused(lambda c: c.all_reduce(np.ones(4), op="mean"), ValueError)
    assert "mean" in m0 and "sum" in m0


def test_length_error_from_the_rust_checks():
    m0, _ = one_rank_refused(lambda c: c.all_reduce(np.ones(4), np.ones(5)), lockstep.CommError)
    assert "4 elements" in m0 and "5" in m0


def test_count_mismatch_between_ranks_names_them():
    def body():
        c = lockstep.comm()
        with pytest.raises(lockstep.CommError) as e:
            c.all_reduce(np.ones(4 + c.rank))
        return str(e.value)

    for m in launch(2, body):
        assert "mismatch" in m and "rank 0" in m and "rank 1" in m, m


def test_comm_error_is_a_runtime_error():
    assert issubclass(lockstep.CommError, RuntimeError)
    assert lockstep.CommError.__module__ == "lockstep"


def test_closed_communicator():
    def body():
        c = lockstep.comm()
        c.close()
        with pytest.raises(lockstep.CommError, match="closed"):
            c.barrier()
        return True

    assert launch(1, body) == [True]


def test_wrong_group_op():
    def body():
        c = lockstep.comm()
        with pytest.raises(ValueError, match="send.*recv"):
            c.group([("sendrecv", np.ones(2), 0)])
        return True

    assert launch(1, body) == [True]


def test_comm_outside_a_rank():
    with pytest.raises(RuntimeError, match="notebook_launcher"):
        lockstep.comm()


class CudaArray:
    """Claims to be CUDA device memory (`__cuda_array_interface__`), as CuPy arrays and torch CUDA
    tensors do."""

    def __init__(self, a):
        self.a = a
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False), "version": 3, "strides": None, "stream": 1}


def test_cuda_memory_on_a_host_communicator():
    m0, _ = one_rank_refused(lambda c: c.all_reduce(CudaArray(np.ones(4, np.float32))), TypeError)
    assert "CUDA device memory" in m0 and "shm backend on host memory" in m0 and "to_device()" in m0, m0


def test_timeout_setting_and_missing_ranks():
    """`timeout` reads and sets this rank's wait; `barrier(timeout=...)` waits that long in the one
    call; a timeout's CommError lists the ranks that had not arrived, and aborts the peers' calls."""
    import time

    def body():
        c = lockstep.comm()
        before = c.timeout
        c.timeout = 120
        got = c.timeout
        with pytest.raises(ValueError, match="finite number of seconds"):
            c.timeout = -1
        with pytest.raises(ValueError, match="finite number of seconds"):
            c.barrier(float("nan"))
        c.barrier()
        if c.rank == 0:
            t0 = time.monotonic()
            with pytest.raises(lockstep.CommError) as e:
                c.barrier(timeout=0.3)
            waited = time.monotonic() - t0
            return before, got, c.timeout, e.value.kind, e.value.missing, waited
        time.sleep(1.5)
        with pytest.raises(lockstep.CommError) as e:  # rank 0 aborted the communicator
            c.barrier()
        return before, got, c.timeout, e.value.kind, e.value.missing, None

    (b0, g0, after0, kind0, missing0, waited), (_, _, _, kind1, missing1, _) = launch(2, body)
    import os

    assert b0 == float(os.environ.get("LOCKSTEP_TIMEOUT_S", 600)) and g0 == after0 == 120.0, (b0, g0, after0)
    assert kind0 == "timeout" and missing0 == [1] and 0.25 < waited < 1.4, (kind0, missing0, waited)
    assert kind1 == "aborted" and missing1 == [], (kind1, missing1)


def test_check_finite_names_the_rank_and_element():
    """`check_finite` turns the finite check on between calls: rank 1's NaN raises kind
    "non_finite" on every rank, naming rank 1 and the element, and the communicator goes on; off
    again, the NaN goes through; ranks that set it differently raise kind "mismatch"."""

    def body():
        c = lockstep.comm()
        before = c.check_finite
        c.check_finite = True
        x = np.ones(8, np.float32)
        if c.rank == 1:
            x[5] = np.inf
        with pytest.raises(lockstep.CommError) as e:
            c.all_reduce(x.copy())
        on = (c.check_finite, e.value.kind, str(e.value))
        y = np.ones(3)
        c.all_reduce(y)  # the communicator goes on
        c.check_finite = c.rank == 0
        with pytest.raises(lockstep.CommError) as m:
            c.all_reduce(np.ones(2))
        c.check_finite = False
        z = x.copy()
        c.all_reduce(z)
        return before, on, y.tolist(), m.value.kind, z.tolist()

    for before, (on, kind, msg), y, mismatch, z in launch(2, body):
        assert before is False and on is True and kind == "non_finite", (before, on, kind)
        assert "rank 1 contributed +Inf at element 5 of all_reduce" in msg and "f32, 8 elements" in msg, msg
        assert y == [2.0] * 3 and mismatch == "mismatch", (y, mismatch)
        assert z[5] == float("inf") and z[0] == 2.0, z
