"""The C ABI of liblockstep.so through Python's ctypes (no numpy), as vLLM's pynccl drives
libnccl.so: every function declared, every collective with checked values, send/recv in a group (a
ring exchange), split (with a lockstepConfig_t), finalize, and error paths (mismatched counts give
an error code and lockstepGetLastError's message; FP8 types are refused).

    python3 capi_ctypes.py path/to/liblockstep.so        (under `lockstep launch`)

Each rank prints "rank R of N: ctypes checks passed"; a failed check raises (exit status 1).
Run by tests/capi.rs.
"""
import ctypes
import sys
from ctypes import POINTER, byref, c_char, c_char_p, c_double, c_float, c_int, c_int32, c_int64, c_size_t, c_void_p

lib = ctypes.CDLL(sys.argv[1])

# lockstep.h, as pynccl declares nccl.h.
Success, InvalidArgument, InvalidUsage, Timeout = 0, 4, 5, 8
Int32, Int64, Float32, Float64, Float8e4m3 = 2, 4, 7, 8, 10
Sum, Prod, Max, Min, Avg = 0, 1, 2, 3, 4
CONFIG_UNDEF_INT = -(2**31)
API_MAGIC = 0x6C6B7374


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", c_char * 128)]


class Config(ctypes.Structure):
    """lockstepConfig_t; the constructor does what LOCKSTEP_CONFIG_INITIALIZER does."""

    _fields_ = [
        ("size", c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", c_int),
        ("timeoutMs", c_int),
        ("commName", c_char_p),
    ]

    def __init__(self, version):
        super().__init__(ctypes.sizeof(Config), API_MAGIC, version, CONFIG_UNDEF_INT, CONFIG_UNDEF_INT, None)


Comm = c_void_p
for name, args in {
    "lockstepGetVersion": [POINTER(c_int)],
    "lockstepGetUniqueId": [POINTER(UniqueId)],
    "lockstepCommInitRank": [POINTER(Comm), c_int, UniqueId, c_int],
    "lockstepCommInitRankConfig": [POINTER(Comm), c_int, UniqueId, c_int, POINTER(Config)],
    "lockstepCommInitFromEnv": [POINTER(Comm)],
    "lockstepCommFinalize": [Comm],
    "lockstepCommDestroy": [Comm],
    "lockstepCommAbort": [Comm],
    "lockstepCommCount": [Comm, POINTER(c_int)],
    "lockstepCommUserRank": [Comm, POINTER(c_int)],
    "lockstepCommSplit": [Comm, c_int, c_int, POINTER(Comm), POINTER(Config)],
    "lockstepCommGetAsyncError": [Comm, POINTER(c_int)],
    "lockstepAllReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepBcast": [c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepBroadcast": [c_void_p, c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_int, Comm, c_void_p],
    "lockstepAllGather": [c_void_p, c_void_p, c_size_t, c_int, Comm, c_void_p],
    "lockstepReduceScatter": [c_void_p, c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepAlltoAll": [c_void_p, c_void_p, c_size_t, c_int, Comm, c_void_p],
    "lockstepGather": [c_void_p, c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepScatter": [c_void_p, c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepSend": [c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepRecv": [c_void_p, c_size_t, c_int, c_int, Comm, c_void_p],
    "lockstepGroupStart": [],
    "lockstepGroupEnd": [],
    "lockstepBarrier": [Comm, c_void_p],
    "lockstepSetLogCallback": [c_void_p, c_void_p],
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

# Bcast (in place), all-to-all, gather to rank 0, scatter from the last rank.
b = arr(c_double, [7.5 if rank == 0 else 0.0] * 16)
ok(lib.lockstepBcast(b, 16, Float64, 0, comm, None), comm)
check(list(b) == [7.5] * 16, f"bcast: {list(b)[:4]}")
s, d = arr(c_int32, [rank * 100 + j for j in range(n) for _ in range(3)]), (c_int32 * (3 * n))()
ok(lib.lockstepAlltoAll(s, d, 3, Int32, comm, None), comm)
check(list(d) == [q * 100 + rank for q in range(n) for _ in range(3)], f"all-to-all: {list(d)}")
s, d = arr(c_int64, [rank] * 5), (c_int64 * (5 * n))()
ok(lib.lockstepGather(s, d if rank == 0 else None, 5, Int64, 0, comm, None), comm)
if rank == 0:
    check(list(d) == [q for q in range(n) for _ in range(5)], f"gather: {list(d)}")
s, d = arr(c_float, [float(j) for j in range(n) for _ in range(4)]), (c_float * 4)()
ok(lib.lockstepScatter(s if rank == n - 1 else None, d, 4, Float32, n - 1, comm, None), comm)
check(list(d) == [float(rank)] * 4, f"scatter: {list(d)}")
code = lib.lockstepAllReduce(s, d, 4, Float8e4m3, Sum, comm, None)
check(code == InvalidArgument and "lockstepFloat8e4m3" in last_error(comm), f"fp8: {code}: {last_error(comm)}")

# Ring exchange in a group: everyone sends to the next rank before receiving from the previous one.
nxt, prv = (rank + 1) % n, (rank - 1) % n
s, d = arr(c_int64, [rank * 7 + i for i in range(4096)]), (c_int64 * 4096)()
ok(lib.lockstepGroupStart())
ok(lib.lockstepSend(s, 4096, Int64, nxt, comm, None), comm)
ok(lib.lockstepRecv(d, 4096, Int64, prv, comm, None), comm)
ok(lib.lockstepGroupEnd(), comm)
check(list(d) == [prv * 7 + i for i in range(4096)], f"ring: {list(d)[:4]}")

# Split: ranks of one parity, ordered by rank, named by a config.
sub = Comm(1)
cfg = Config(version.value)
cfg.commName = b"parity"
ok(lib.lockstepCommSplit(comm, rank % 2, rank, byref(sub), byref(cfg)), comm)
m = c_int()
ok(lib.lockstepCommCount(sub, byref(m)))
check(m.value == len(range(rank % 2, n, 2)), f"split: {m.value} ranks")
x, y = c_int32(rank), c_int32()
ok(lib.lockstepAllReduce(byref(x), byref(y), 1, Int32, Sum, sub, None), sub)
check(y.value == sum(range(rank % 2, n, 2)), f"split all-reduce: {y.value}")
code = lib.lockstepCommCount(sub, None)
check(code == InvalidArgument and 'communicator "parity"' in last_error(sub), f"named split: {last_error(sub)}")
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
bad = Config(version.value)
bad.magic = 0
code = lib.lockstepCommInitRankConfig(byref(Comm()), 2, UniqueId(), 0, byref(bad))
check(code == InvalidArgument and "config->magic" in last_error(), f"bad config: {code}: {last_error()}")
ok(lib.lockstepBarrier(comm, None), comm)
ok(lib.lockstepCommFinalize(comm), comm)
ok(lib.lockstepCommDestroy(comm))
print(f"rank {rank} of {n}: ctypes checks passed")
