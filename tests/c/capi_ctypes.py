"""The C ABI of liblockstep.so through Python's ctypes (no numpy), as vLLM's pynccl drives
libnccl.so: every collective with checked values, send/recv in a group (a ring exchange), split,
and an error path (mismatched counts give an error code and lockstepGetLastError's message).

    python3 capi_ctypes.py path/to/liblockstep.so        (under `lockstep launch`)

Each rank prints "rank R of N: ctypes checks passed"; a failed check raises (exit status 1).
Run by tests/capi.rs.
"""
import ctypes
import sys
from ctypes import POINTER, byref, c_char, c_char_p, c_double, c_float, c_int, c_int32, c_int64, c_size_t, c_void_p

lib = ctypes.CDLL(sys.argv[1])

# lockstep.h, as pynccl declares nccl.h.
Success, InvalidArgument, InvalidUsage = 0, 4, 5
Int32, Int64, Float32, Float64 = 2, 4, 7, 8
Sum, Prod, Max, Min, Avg = 0, 1, 2, 3, 4


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", c_char * 128)]


Comm = c_void_p
for name, args in {
    "lockstepGetVersion": [POINTER(c_int)],
    "lockstepGetUniqueId": [POINTER(UniqueId)],
    "lockstepCommInitRank": [POINTER(Comm), c_int, UniqueId, c_int],
    "lockstepCommInitFromEnv": [POINTER(Comm)],
    "lockstepCommDestroy": [Comm],
    "lockstepCommCount": [Comm, POINTER(c_int)],
    "lockstepCommUserRank": [Comm, POINTER(c_int)],
    "lockstepCommSplit": [Comm, c_int, c_int, POINTER(Comm), c_void_p],
    "lockstepCommGetAsyncError": [Comm, POINTER(c_int)],
    "lockstepAllReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepBroadcast": [c_void_p, c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_int, Comm, c_void_p],
    "lockstepAllGather": [c_void_p, c_void_p, c_size_t, c_int, Comm, c_void_p],
    "lockstepReduceScatter": [c_void_p, c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepSend": [c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepRecv": [c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepGroupStart": [],
    "lockstepGroupEnd": [],
    "lockstepBarrier": [Comm, c_void_p],
}.items():
    f = getattr(lib, name)
    f.argtypes, f.restype = args, c_int
lib.lockstepGetErrorString.argtypes, lib.lockstepGetErrorString.restype = [c_int], c_char_p
lib.lockstepGetLastError.argtypes, lib.lockstepGetLastError.restype = [Comm], c_char_p


def last_error(comm=None):
    return lib.lockstepGetLastError(comm).decode()


def ok(code, comm=None):
    if code != Success:
        raise AssertionError(f"returned {code} ({lib.lockstepGetErrorString(code).decode()}): {last_error(comm)}")


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def arr(ctype, values):
    return (ctype * len(values))(*values)


comm = Comm()
ok(lib.lockstepCommInitFromEnv(byref(comm)))
n, rank, version = c_int(), c_int(), c_int()
ok(lib.lockstepCommCount(comm, byref(n)))
ok(lib.lockstepCommUserRank(comm, byref(rank)))
ok(lib.lockstepGetVersion(byref(version)))
n, rank = n.value, rank.value
check(0 <= rank < n and version.value >= 100, f"rank {rank} of {n}, version {version.value}")

# All-reduce: every operator on int64, in-place average on float64.
vals = [r + 2 for r in range(n)]
prod = 1
for v in vals:
    prod *= v
for op, want in [(Sum, sum(vals)), (Prod, prod), (Max, max(vals)), (Min, min(vals)), (Avg, sum(vals) // n)]:
    s, d = arr(c_int64, [rank + 2] * 100), (c_int64 * 100)()
    ok(lib.lockstepAllReduce(s, d, 100, Int64, op, comm, None), comm)
    check(list(d) == [want] * 100, f"all-reduce op {op}: {d[0]} != {want}")
f = arr(c_double, [rank + 0.5] * 1000)
ok(lib.lockstepAllReduce(f, f, 1000, Float64, Avg, comm, None), comm)
check(all(x == sum(r + 0.5 for r in range(n)) / n for x in f), f"in-place avg: {f[0]}")

# Broadcast from the last rank (sendbuff NULL elsewhere), reduce to rank 0 (recvbuff NULL elsewhere).
root = n - 1
s, d = arr(c_float, [rank * 10.0 + i for i in range(64)]), (c_float * 64)()
ok(lib.lockstepBroadcast(s if rank == root else None, d, 64, Float32, root, comm, None), comm)
check(list(d) == [root * 10.0 + i for i in range(64)], f"broadcast: {list(d)[:4]}")
s, d = arr(c_int32, [rank * 1000 + i for i in range(50)]), (c_int32 * 50)()
ok(lib.lockstepReduce(s, d if rank == 0 else None, 50, Int32, Sum, 0, comm, None), comm)
if rank == 0:
    check(list(d) == [sum(r * 1000 + i for r in range(n)) for i in range(50)], f"reduce: {list(d)[:4]}")

# All-gather, and reduce-scatter in place (the result lands at sendbuff + rank * recvcount).
s, d = arr(c_int32, [rank * 100 + i for i in range(10)]), (c_int32 * (10 * n))()
ok(lib.lockstepAllGather(s, d, 10, Int32, comm, None), comm)
check(list(d) == [r * 100 + i for r in range(n) for i in range(10)], f"all-gather: {list(d)}")
buf = arr(c_float, [float(rank + 1)] * (8 * n))
block = ctypes.cast(ctypes.addressof(buf) + rank * 8 * ctypes.sizeof(c_float), c_void_p)
ok(lib.lockstepReduceScatter(buf, block, 8, Float32, Sum, comm, None), comm)
check(list(buf)[rank * 8:(rank + 1) * 8] == [n * (n + 1) / 2] * 8, f"reduce-scatter: {list(buf)}")

# Ring exchange in a group: everyone sends to the next rank before receiving from the previous one.
nxt, prv = (rank + 1) % n, (rank - 1) % n
s, d = arr(c_int64, [rank * 7 + i for i in range(4096)]), (c_int64 * 4096)()
ok(lib.lockstepGroupStart())
ok(lib.lockstepSend(s, 4096, Int64, nxt, comm, None), comm)
ok(lib.lockstepRecv(d, 4096, Int64, prv, comm, None), comm)
ok(lib.lockstepGroupEnd(), comm)
check(list(d) == [prv * 7 + i for i in range(4096)], f"ring: {list(d)[:4]}")

# Split: ranks of one parity, ordered by rank.
sub = Comm(1)
ok(lib.lockstepCommSplit(comm, rank % 2, rank, byref(sub), None), comm)
m = c_int()
ok(lib.lockstepCommCount(sub, byref(m)))
check(m.value == len(range(rank % 2, n, 2)), f"split: {m.value} ranks")
x, y = c_int32(rank), c_int32()
ok(lib.lockstepAllReduce(byref(x), byref(y), 1, Int32, Sum, sub, None), sub)
check(y.value == sum(range(rank % 2, n, 2)), f"split all-reduce: {y.value}")
ok(lib.lockstepCommDestroy(sub))
print(f"rank {rank}: ctypes split: verified")

# Mismatched counts: an error code and a message on every rank, and the communicator still works.
if n > 1:
    s, d = (c_float * 8)(), (c_float * 8)()
    code = lib.lockstepAllReduce(s, d, 4 if rank == 0 else 5, Float32, Sum, comm, None)
    msg = last_error(comm)
    check(code == InvalidUsage and "mismatch" in msg, f"mismatch: {code}: {msg}")
    print(f"rank {rank}: ctypes mismatch: code {code}: {msg}")
    err = c_int(-1)
    ok(lib.lockstepCommGetAsyncError(comm, byref(err)))
    check(err.value == Success, f"async error {err.value}")
code = lib.lockstepCommCount(None, byref(c_int()))
check(code == InvalidArgument and "comm is NULL" in last_error(), f"NULL comm: {code}: {last_error()}")
check(lib.lockstepGroupEnd() == InvalidUsage, "GroupEnd without GroupStart")
ok(lib.lockstepBarrier(comm, None), comm)
ok(lib.lockstepCommDestroy(comm))
print(f"rank {rank} of {n}: ctypes checks passed")
