"""Device communicators from Python without a GPU: `Communicator.to_device()` in ranks forked by
notebook_launcher, on the simulated CUDA driver of the Rust tests (tests/fake/sim_cuda.c: device
memory is host memory and copies are memcpy, so a numpy array can stand for device memory behind
`__cuda_array_interface__`). With one simulated device for two ranks, lockstep stages the device
buffers through shared memory; real CUDA tensors on NCCL need a GPU."""

import numpy as np
import pytest

import lockstep
from conftest import launch


class CudaArray:
    """A numpy array presented as CUDA device memory (`__cuda_array_interface__` version 3)."""

    def __init__(self, a, strides=None, readonly=False):
        self.a = a
        self.__cuda_array_interface__ = {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "data": (a.ctypes.data, readonly),
            "version": 3,
            "strides": strides,
            "stream": 1,
        }


def test_device_communicator_on_the_simulated_driver(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CUDA_LIBRARY", str(fake_cuda))

    def body():
        host = lockstep.comm()
        assert host.device is None
        dev = host.to_device()
        r, n = dev.rank, dev.world_size
        x = np.full(6, r + 1.0, np.float32)
        dev.all_reduce(CudaArray(x))  # in place
        src, out = np.arange(4, dtype=np.int64) * (r + 1), np.zeros(4, np.int64)
        dev.all_reduce(CudaArray(src), CudaArray(out), op="max")
        gathered = np.zeros(2 * n, np.float64)
        dev.all_gather(CudaArray(np.full(2, float(r))), CudaArray(gathered))
        b = np.full(3, float(r), np.float32)
        dev.broadcast(CudaArray(b), root=1)
        errors = {}
        # Every rank makes the same wrong call, so each raises its own error.
        for name, bad in [
            ("host", lambda: dev.all_reduce(np.ones(2, np.float32))),
            ("strided", lambda: dev.all_reduce(CudaArray(np.ones(8, np.float32), strides=(8,)))),
            ("readonly", lambda: dev.all_reduce(CudaArray(np.ones(2, np.float32), readonly=True))),
            ("int16", lambda: dev.all_reduce(CudaArray(np.ones(2, np.int16)))),
        ]:
            with pytest.raises((TypeError, ValueError)) as e:
                bad()
            errors[name] = (type(e.value).__name__, str(e.value))
        with pytest.raises(ValueError) as e:
            dev.to_device()
        errors["again"] = str(e.value)
        with pytest.raises(lockstep.CommError) as e:
            host.barrier()
        errors["host closed"] = str(e.value)
        y = np.ones(2, np.float32)
        dev.all_reduce(CudaArray(y))  # still in step after the refusals
        return dev.backend, dev.device, x.tolist(), out.tolist(), gathered.tolist(), b.tolist(), errors, y.tolist()

    for backend, device, x, out, gathered, b, errors, y in launch(2, body):
        assert device == 0 and backend != "shm", backend
        assert x == [3.0] * 6
        assert out == [0, 2, 4, 6]
        assert gathered == [0.0, 0.0, 1.0, 1.0]
        assert b == [1.0] * 3
        assert y == [2.0, 2.0]
        kind, msg = errors["host"]
        assert kind == "TypeError" and "host memory" in msg and "CUDA device 0" in msg and ".cuda(0)" in msg, msg
        kind, msg = errors["strided"]
        assert kind == "ValueError" and "not C-contiguous" in msg, msg
        kind, msg = errors["readonly"]
        assert kind == "ValueError" and "read-only" in msg, msg
        kind, msg = errors["int16"]
        assert kind == "TypeError" and "not a lockstep element type" in msg, msg
        assert "already runs" in errors["again"], errors["again"]
        assert "closed" in errors["host closed"], errors["host closed"]
