"""torch's Flight Recorder format, written from lockstep's own recorder.

torch 2.15 records the collectives of every backend not in ``_FR_SELF_RECORDING_BACKENDS``
through a ``FlightRecorderHook`` that runs around each call (a cost paid on every collective, the
8-byte ones included). lockstep records every call already, in Rust, in each communicator's ring
(``Communicator.trace()``, ``LOCKSTEP_TRACE_BUFFER``), so ``lockstep.torch`` declares the backend
self-recording and produces torch's dumps from that ring instead, only when one is asked for:

- the pickle torch's ``_dump_fr_trace(backend="lockstep")`` returns, and the JSON of
  ``_dump_fr_trace_json``: ``lockstep.torch`` wraps those entry points of
  ``torch._C._distributed_c10d`` so that a program (or torch's own tooling) asking for the
  "lockstep" recorder gets this one; other backends' dumps are torch's, unchanged;
- the file of ``_dump_fr_trace_file(rank, backend="lockstep")``, where torch's NCCL writes its
  own: ``TORCH_FR_DUMP_TEMP_FILE`` + rank (default ``~/.cache/torch/comm_lib_trace_rank_<rank>``),
  written when a collective fails with ``TORCH_FR_DUMP_ON_TIMEOUT=1``, by
  :func:`lockstep.torch.dump_flight_recorder`, and on ``SIGUSR1`` where lockstep handles it
  (``LOCKSTEP_TRACE_DIR`` set) and ``TORCH_FR_DUMP_TEMP_FILE`` is set: lockstep's thread
  ``lockstep-trace`` writes it after lockstep's own trace files, so a rank stuck in a
  collective (which has released the GIL) is dumped too.

``torchfrtrace`` (``torch.distributed.flight_recorder``) reads these files as torch's own. What
the format takes from each record: the operation (``profiling_name`` ``lockstep:<op>``, with
``send a->b`` and ``recv b<-a`` for point-to-point calls, ranks of the group), its number among
the group's collectives (``collective_seq_id``; point-to-point calls count in ``p2p_seq_id``),
its element type and count (``input_sizes`` and ``output_sizes`` as flat shapes: lockstep sees
buffers, not the tensors' shapes), its state (``completed``; ``started`` while it runs and when it
failed, since it never completed), and its times where the ring timed it (every call of 64 KiB or
more, every 64th smaller collective; the others carry the time of the last timed call before
them). A group's CUDA tensors run on a second communicator, which appears as a group of its own,
named after torch's group with ``:cuda`` appended. Entries are grouped by group (torch's recorder
interleaves the groups' calls in the order made; lockstep's rings are per communicator).
"""

import json
import os
import pickle

import torch.distributed as dist

# The format version written when torch's own cannot be read (torch 2.15's).
_VERSION = "2.10"

# lockstep's element type names to torch's ScalarType names, as torch's recorder writes them.
_DTYPES = {
    "f32": "Float",
    "f64": "Double",
    "f16": "Half",
    "bf16": "BFloat16",
    "i8": "Char",
    "u8": "Byte",
    "i32": "Int",
    "i64": "Long",
    "u32": "UInt32",
    "u64": "UInt64",
}

# torch's names for the collectives whose name differs from lockstep's: an all-to-all with
# per-peer counts is torch's all_to_all_single (checked by total size across ranks, as torch's
# analysis does for uneven exchanges).
_NAMES = {"all_to_all_v": "all_to_all_single"}


def _buffer_size():
    """torch's Flight Recorder size (``TORCH_FR_BUFFER_SIZE``, then ``TORCH_NCCL_TRACE_BUFFER_SIZE``,
    2000 when neither is set; 0 turns it off), read as torch's ``_maybe_attach_flight_recorder``
    reads it."""
    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = os.environ.get(var)
        if value:
            try:
                return int(value)
            except ValueError:
                return 2000
    return 2000


def _sizes(kind, count, world):
    """(input_sizes, output_sizes) of a call of `kind` with lockstep's per-rank `count` (NCCL's
    definition: the receive count of reduce_scatter and scatter, the per-peer block of
    all_to_all) in a group of `world` ranks."""
    if kind == "barrier":
        return [], []
    if kind in ("all_gather", "gather"):
        return [[count]], [[count * world]]
    if kind in ("reduce_scatter", "scatter"):
        return [[count * world]], [[count]]
    if kind == "all_to_all":
        return [[count * world]], [[count * world]]
    return [[count]], [[count]]


def _entries(records, pg_id, pg, world, rank, timeout_ms, first_id):
    """torch's entries for the records of one communicator (`records`: ``Communicator.trace()``),
    as group `pg` (torch's (name, description)) of `world` ranks where this process is `rank`;
    record ids from `first_id` on, each the communicator's own record number."""
    out = []
    p2p = 0
    last_seq = 0
    last_ns = 0
    for r in records:
        kind = r["op"]
        is_p2p = kind in ("send", "recv")
        if is_p2p:
            p2p += 1
            peer = r.get("root")
            peer = "?" if peer is None or peer >= world else str(peer)
            name = f"send {rank}->{peer}" if kind == "send" else f"recv {rank}<-{peer}"
            count = r["count"]
            ins, outs = ([[count]], []) if kind == "send" else ([], [[count]])
        else:
            last_seq = r["seq"]
            name = _NAMES.get(kind, kind)
            ins, outs = _sizes(kind, r["count"], world)
        start, end = r.get("start_ns"), r.get("end_ns")
        last_ns = start or end or last_ns
        done = r["state"] == "ok"
        dtype = [_DTYPES.get(r["dtype"], r["dtype"])]
        out.append(
            {
                "record_id": first_id + r["id"] - 1,
                "pg_id": pg_id,
                "process_group": pg,
                "collective_seq_id": last_seq,
                "p2p_seq_id": p2p if is_p2p else 0,
                "op_id": r["id"] - 1,
                "profiling_name": f"lockstep:{name}",
                "time_created_ns": last_ns,
                "input_sizes": ins,
                "input_dtypes": dtype if ins else [],
                "output_sizes": outs,
                "output_dtypes": dtype if outs else [],
                "state": "completed" if done else "started",
                "time_discovered_started_ns": start,
                "time_discovered_completed_ns": end if done else None,
                "retired": done,
                "timeout_ms": timeout_ms,
                "is_p2p": is_p2p,
                "thread_id": "",
                "thread_name": "",
            }
        )
    return out


def _groups():
    """(torch's group name, its description, global ranks in group-rank order, lockstep backend)
    of every live process group whose CPU backend is lockstep's, the default group first."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    from . import torch as lt

    world = c10d._world
    out = []
    for pg, name in list(world.pg_names.items()):
        try:
            backend = pg._get_backend(torch.device("cpu"))
        except Exception:
            continue
        if not isinstance(backend, lt._Ops):
            continue
        ranks = world.pg_group_ranks.get(pg, {})
        ordered = [g for g, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
        desc = getattr(pg, "group_desc", None) or "undefined"
        out.append((pg is not world.default_pg, name, desc, ordered, backend))
    out.sort(key=lambda g: g[0])
    return [g[1:] for g in out]


def trace(include_collectives=True, only_active=False):
    """This process's Flight Recorder for the lockstep groups, as torch's dump holds it (a dict:
    version, comm_lib_version, pg_config, pg_status, entries)."""
    from . import __version__

    keep = _buffer_size()
    pg_config, pg_status, entries = {}, {}, []
    for pg_id, (name, desc, ranks, backend) in enumerate(_groups()):
        # torch's timeout of the group (reading the communicator's would wait for a call that
        # runs on another thread).
        timeout = getattr(getattr(backend, "_options", None), "_timeout", None)
        timeout_ms = int(timeout.total_seconds() * 1000) if timeout is not None else 0
        comms = [(name, backend._comm)]
        if backend._device_comm is not None:
            comms.append((f"{name}:cuda", backend._device_comm))
        for k, (pg_name, comm) in enumerate(comms):
            pg_config[pg_name] = {"name": pg_name, "desc": desc, "ranks": str(ranks)}
            records = comm.trace() if keep > 0 else []
            records = records[-keep:] if keep > 0 else []
            seqs = [r["seq"] for r in records if r["seq"]]
            done = [r["seq"] for r in records if r["seq"] and r["state"] == "ok"]
            pg_status[pg_name] = {
                "last_enqueued_collective": max(seqs, default=-1),
                "last_started_collective": max(seqs, default=-1),
                "last_completed_collective": max(done, default=-1),
            }
            # Record ids as torch's analysis aligns them across ranks (it drops, on every rank,
            # the records older than the newest first record of any rank): the default group's
            # are the communicator's own numbers, every other communicator's start far above,
            # so that a rank's first record is its default group's.
            first_id = (2 * pg_id + k) << 40
            got = _entries(records, pg_id, (pg_name, desc), comm.world_size, comm.rank, timeout_ms, first_id)
            if only_active:
                got = [e for e in got if not e["retired"]]
            entries.extend(got)
    out = {
        "version": _torch_version(),
        "comm_lib_version": f"lockstep {__version__}",
        "pg_config": pg_config,
        "pg_status": pg_status,
    }
    if include_collectives is not False:
        out["entries"] = entries
    return out


def _torch_version():
    """The format version torch's own recorder writes (read from an empty dump of it)."""
    try:
        import torch._C._distributed_c10d as c

        return pickle.loads(_TORCH.get("_dump_fr_trace", c._dump_fr_trace)(backend="gloo"))["version"]
    except Exception:
        return _VERSION


def dump_path(rank):
    """Where torch writes rank `rank`'s dump: ``TORCH_FR_DUMP_TEMP_FILE`` + rank (default
    ``~/.cache/torch/comm_lib_trace_rank_<rank>``)."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.path.join(os.path.expanduser("~"), ".cache", "torch", "comm_lib_trace_rank_")
    return f"{prefix}{rank}"


def write(rank, include_collectives=True, only_active=False):
    """Write this process's dump to :func:`dump_path` (atomically: a reader never sees half a
    file) and return the path."""
    path = dump_path(rank)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    data = pickle.dumps(trace(include_collectives, only_active))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def on_signal():
    """SIGUSR1 (on lockstep's thread ``lockstep-trace``, where ``LOCKSTEP_TRACE_DIR`` is set):
    write this process's dump beside lockstep's own trace files, when ``TORCH_FR_DUMP_TEMP_FILE``
    says where (a signal writes nowhere the program did not name)."""
    if not os.environ.get("TORCH_FR_DUMP_TEMP_FILE"):
        return
    try:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        write(rank)
    except Exception:
        import logging

        logging.getLogger("lockstep.torch").warning("SIGUSR1: could not write torch's Flight Recorder dump", exc_info=True)


# torch's dump entry points, as they were before `install` wrapped them.
_TORCH = {}


def install(self_recording):
    """Wrap torch's ``_dump_fr_trace``, ``_dump_fr_trace_json`` and ``_dump_fr_trace_file`` so
    that, for ``backend="lockstep"`` while lockstep records itself (`self_recording()`), they
    dump lockstep's recorder; every other call is torch's own."""
    import torch._C._distributed_c10d as c

    if _TORCH or not all(hasattr(c, n) for n in ("_dump_fr_trace", "_dump_fr_trace_json", "_dump_fr_trace_file")):
        return
    from . import torch as lt

    _TORCH.update({n: getattr(c, n) for n in ("_dump_fr_trace", "_dump_fr_trace_json", "_dump_fr_trace_file")})

    def ours(backend):
        return backend == lt.BACKEND and self_recording()

    def _dump_fr_trace(includeCollectives=None, includeStackTraces=None, onlyActive=None, backend="gloo"):
        if ours(backend):
            return pickle.dumps(trace(includeCollectives, bool(onlyActive)))
        return _TORCH["_dump_fr_trace"](includeCollectives, includeStackTraces, onlyActive, backend=backend)

    def _dump_fr_trace_json(includeCollectives=None, onlyActive=None, backend="gloo"):
        if ours(backend):
            return json.dumps(trace(includeCollectives, bool(onlyActive))).encode()
        return _TORCH["_dump_fr_trace_json"](includeCollectives, onlyActive, backend=backend)

    def _dump_fr_trace_file(rank, includeCollectives=None, includeStackTraces=None, onlyActive=None, backend="gloo"):
        if ours(backend):
            write(rank, includeCollectives, bool(onlyActive))
            return None
        return _TORCH["_dump_fr_trace_file"](rank, includeCollectives, includeStackTraces, onlyActive, backend=backend)

    for f in (_dump_fr_trace, _dump_fr_trace_json, _dump_fr_trace_file):
        f.__doc__ = f"torch's ``{f.__name__}``; for backend='lockstep', lockstep's own recorder (``lockstep._flight``).\n\n{_TORCH[f.__name__].__doc__}"
        setattr(c, f.__name__, f)
