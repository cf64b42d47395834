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


def _stream_ordered_calls(log_dir, nccl):
    """Rank body: two all-reduces on a device communicator whose stream is set, under the
    simulated driver's call log; returns the log's lines, the caller's stream handle and the
    result."""
    import os

    r = lockstep.comm().rank
    os.environ["SIM_CALL_LOG"] = f"{log_dir}/rank{r}.log"
    dev = lockstep.comm().to_device()
    assert (dev.backend == "nccl") == nccl, dev.backend
    caller = 0x5000 + r  # the simulator never dereferences a stream handle
    x = np.full(4, r + 1.0, np.float32)
    dev.stream = caller
    assert dev.stream == caller
    open(os.environ["SIM_CALL_LOG"], "w").close()
    dev.all_reduce(CudaArray(x))
    dev.all_reduce(CudaArray(x))
    dev.stream = None
    with open(os.environ["SIM_CALL_LOG"]) as f:
        lines = [line.split() for line in f]
    return lines, hex(caller), x.tolist()


def _check_order(lines, caller):
    """Each call: an event recorded on the caller's stream that the communicator's stream waits
    on, then (later) an event recorded on the communicator's stream that the caller's waits on;
    never the device or the caller's stream synchronised."""
    text = "\n".join(" ".join(line) for line in lines)
    assert not any(line[0] == "cuCtxSynchronize" for line in lines), text
    assert not any(line[0] == "cuStreamSynchronize" and line[1] == caller for line in lines), text
    enters = [i for i, line in enumerate(lines) if line[0] == "cuEventRecord" and line[2] == caller]
    leaves = [i for i, line in enumerate(lines) if line[0] == "cuStreamWaitEvent" and line[1] == caller]
    assert len(enters) == 2 and len(leaves) == 2, text
    for enter, leave in zip(enters, leaves):
        event = lines[enter][1]
        waits = [i for i, line in enumerate(lines) if line[0] == "cuStreamWaitEvent" and line[2] == event and i > enter]
        assert waits and waits[0] < leave, text
        own = lines[waits[0]][1]
        out_event = lines[leave][2]
        records = [i for i, line in enumerate(lines) if line[:3] == ["cuEventRecord", out_event, own] and enter < i < leave]
        assert records, text
    return text


def test_stream_ordered_calls_on_nccl(fake_cuda, fake_nccl, monkeypatch, tmp_path):
    """`Communicator.stream` on NCCL (two simulated devices): no synchronisation at all."""
    monkeypatch.setenv("LOCKSTEP_CUDA_LIBRARY", str(fake_cuda))
    monkeypatch.setenv("LOCKSTEP_NCCL_LIBRARY", str(fake_nccl))
    monkeypatch.setenv("SIM_CUDA_DEVICES", "2")
    rdzv = tmp_path / "rdzv"
    rdzv.mkdir()
    monkeypatch.setenv("SIM_NCCL_RDZV_DIR", str(rdzv))
    for lines, caller, _ in launch(2, _stream_ordered_calls, str(tmp_path), True):
        text = _check_order(lines, caller)
        assert "Synchronize" not in text, text
        assert sum(line[0] == "ncclAllReduce" for line in lines) == 2, text


def test_stream_ordered_calls_staged(fake_cuda, monkeypatch, tmp_path):
    """`Communicator.stream` when ranks share a device (staged): the staging stream is ordered
    with the caller's; the caller's stream and the device are never synchronised."""
    monkeypatch.setenv("LOCKSTEP_CUDA_LIBRARY", str(fake_cuda))
    for lines, caller, x in launch(2, _stream_ordered_calls, str(tmp_path), False):
        _check_order(lines, caller)
        assert x == [6.0] * 4  # (1 + 2), then (3 + 3)


def test_stream_only_on_device_communicators():
    def body():
        c = lockstep.comm()
        with pytest.raises(ValueError) as e:
            c.stream = 1
        c.stream = None
        return str(e.value), c.stream

    for msg, stream in launch(1, body):
        assert "no CUDA stream" in msg and stream is None, msg
