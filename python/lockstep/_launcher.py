"""``notebook_launcher``: fork ranks from the calling process (a Jupyter kernel, a script), run a
function in each with a ready communicator, and bring back every rank's return value.

Why Python's ``os.fork`` and not the Rust launcher's fork: ``os.fork`` runs the interpreter's own
before/after-fork protocol (the GIL, the threading module, the import lock, ``register_at_fork``
handlers such as logging's), which a fork from Rust code would skip. The Rust library supplies the
rest: the pre-fork checks (CUDA initialised here, malformed ``LOCKSTEP_*`` variables), the shared
segment the ranks join (an anonymous memfd, so nothing can be left in /dev/shm), and the
communicator each rank gets.

Process layout: each rank is a child of the caller in its own process group (so a terminal's
Ctrl-C reaches the caller only, which then stops every rank, and killing the group also takes
what the rank started), with ``PR_SET_PDEATHSIG`` so a killed kernel takes its ranks along.
Each rank's stdout and stderr (file descriptors 1 and 2, so C-level output too) come back through
pipes and are written line by line, prefixed ``[rank N]``, to the caller's ``sys.stdout`` and
``sys.stderr`` (a notebook shows both in the cell). The return value (or the exception and its
traceback) comes back pickled through a third pipe.
"""

import collections
import io
import os
import pickle
import selectors
import shutil
import signal
import stat
import sys
import tempfile
import time
import traceback
import warnings

from . import _native

# The communicator of this process when it is a notebook_launcher rank.
_COMM = None
_IN_RANK = False

_MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")


def comm():
    """The communicator of this rank, inside a function run by :func:`notebook_launcher`."""
    if _COMM is None:
        raise RuntimeError(
            "lockstep.comm() is only available inside a function run by lockstep.notebook_launcher; "
            "in a process started by `lockstep launch`, torchrun or mpirun, use lockstep.init_from_env()"
        )
    return _COMM


def init_from_env():
    """Join the job described by the launcher's environment (``lockstep launch``, torchrun,
    mpirun, srun) and return its :class:`lockstep.Communicator`. Inside a
    :func:`notebook_launcher` rank it returns that rank's communicator, so the same training
    function runs under both."""
    if _COMM is not None:
        return _COMM
    return _native.init_from_env()


def check_fork_safe():
    """Raise RuntimeError, with lockstep's diagnosis, when ranks cannot be forked from this
    process: CUDA already initialised here (by torch, pynvml, cupy or anything else: the driver
    itself is asked, so it is caught even when ``torch.cuda.is_initialized()`` is False), or a
    malformed ``LOCKSTEP_*`` environment variable."""
    why = _native.fork_refusal()
    if why is not None:
        raise RuntimeError(why)


class RankError(RuntimeError):
    """A rank of :func:`notebook_launcher` failed; raised in the caller.

    Attributes: ``rank`` (the first rank seen failing), ``exc_type`` (its exception's type name,
    or None when it died without raising), ``traceback`` (that rank's traceback, as text),
    ``failures`` (``{rank: description}`` for every rank that failed, the ones stopped because of
    the first included). The rank's own exception, when it could be pickled, is ``__cause__``.
    """

    def __init__(self, message, rank, exc_type, traceback_text, failures):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.traceback = traceback_text
        self.failures = failures

    def __reduce__(self):
        return (RankError, (str(self), self.rank, self.exc_type, self.traceback, self.failures))


RankError.__module__ = "lockstep"


class _Rank:
    """The caller's view of one forked rank."""

    def __init__(self, rank, pid, out_fd, err_fd, res_fd):
        self.rank = rank
        self.pid = pid
        self.streams = {out_fd: "out", err_fd: "err", res_fd: "res"}
        self.partial = {"out": b"", "err": b""}
        self.result = bytearray()
        self.result_done = False
        # ("ok", value) or ("err", type, message, traceback, pickled exception, follows): follows
        # is the rank whose failure the error is a consequence of (CommError.follows), or None.
        self.outcome = None
        self.status = None  # exit code, or -signal, once reaped
        self.reaped_at = None
        self.stopped = False  # terminated by the launcher
        self.err_tail = collections.deque(maxlen=20)

    def fds(self):
        return list(self.streams)

    def failed(self):
        if self.outcome is not None and self.outcome[0] == "err":
            return True
        return self.status is not None and (self.status != 0 or (self.result_done and self.outcome is None))


def notebook_launcher(
    function,
    args=(),
    num_processes=None,
    mixed_precision="no",
    use_port="29500",
    master_addr="127.0.0.1",
    node_rank=0,
    num_nodes=1,
    rdzv_backend="static",
    rdzv_endpoint="",
    rdzv_conf=None,
    rdzv_id="none",
    max_restarts=0,
    monitor_interval=0.1,
    log_line_prefix_template=None,
    *,
    fail_fast=True,
    grace=3.0,
    restart_policy="job",
):
    """Fork ``num_processes`` ranks from this process; each runs ``function(*args)`` with its
    communicator available as :func:`lockstep.comm`. Returns the ranks' return values, a list in
    rank order (they come back pickled). Accelerate's signature, so notebooks port by changing
    the import.

    * ``num_processes``: number of ranks (default 2, CPU ranks; pass it explicitly for GPUs).
    * ``mixed_precision`` (``"no"``, ``"fp16"``, ``"bf16"``, ``"fp8"``), ``use_port`` and
      ``master_addr`` are exported to the ranks as Accelerate does (``ACCELERATE_MIXED_PRECISION``,
      ``MASTER_PORT``, ``MASTER_ADDR``), with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
      ``LOCAL_WORLD_SIZE``; lockstep itself needs none of them.
    * ``node_rank``, ``num_nodes`` and ``rdzv_*`` concern multi-node torch elastic jobs: only
      their defaults are accepted (use ``lockstep launch`` across nodes).
    * ``max_restarts``: when a rank fails, stop every rank and start them all again, up to this
      many times, as torch elastic's restarts under Accelerate (each attempt gets a new shared
      segment; ranks see ``LOCKSTEP_RESTART_COUNT`` and ``TORCHELASTIC_RESTART_COUNT``, 0 on the
      first attempt). The last attempt's failure is raised. ``restart_policy`` (lockstep) must be
      ``"job"``: replacing one rank while the others run needs a launcher process that never
      initialised CUDA, which a forked launch does not have (``lockstep launch --restart-policy
      rank`` does).
    * ``monitor_interval``: seconds between checks of the ranks' exit status.
    * ``log_line_prefix_template``: the prefix of each output line; ``${rank}`` and
      ``${local_rank}`` are replaced (default ``"[rank ${rank}] "``).
    * ``fail_fast`` (lockstep): when a rank fails, terminate the others (SIGTERM, then SIGKILL
      after ``grace`` seconds) instead of waiting for them.

    When torch is imported in this process, each rank starts with torch.distributed's default
    process group initialised on the ``"lockstep"`` backend (see :mod:`lockstep.torch`).

    A failing rank raises :class:`RankError` here, with the rank number and that rank's
    traceback. KeyboardInterrupt (the notebook's interrupt button, Ctrl-C) stops every rank and
    everything they started before it propagates. It refuses to fork when CUDA is initialised in
    this process (see :func:`check_fork_safe`). It can be called any number of times.
    """
    if _IN_RANK:
        raise RuntimeError("notebook_launcher was called inside one of its own ranks; launch ranks from the top-level process only")
    if not callable(function):
        raise TypeError(f"function must be callable, not {type(function).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of arguments for function, not {type(args).__name__}")
    n = 2 if num_processes is None else num_processes
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_processes must be a positive integer, not {num_processes!r}")
    mp = str(mixed_precision).lower()
    if mp not in _MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {', '.join(_MIXED_PRECISION)}, not {mixed_precision!r}")
    elastic = {
        "node_rank": (node_rank, 0),
        "num_nodes": (num_nodes, 1),
        "rdzv_backend": (rdzv_backend, "static"),
        "rdzv_endpoint": (rdzv_endpoint, ""),
        "rdzv_conf": (rdzv_conf, None),
        "rdzv_id": (rdzv_id, "none"),
    }
    for name, (value, default) in elastic.items():
        if value != default and not (name == "rdzv_conf" and value == {}):
            raise ValueError(
                f"{name}={value!r} is not supported: notebook_launcher forks every rank on this machine "
                f"(leave {name} at {default!r}; for several nodes, run a script with `lockstep launch`)"
            )
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number, 0 or more (0: no restarts), not {max_restarts!r}")
    if restart_policy == "rank":
        raise ValueError(
            "restart_policy='rank' is not possible in notebook_launcher: a replacement rank would have to be forked from "
            "this process after the others started, and no launcher process that never initialised CUDA is there to fork "
            "it; use restart_policy='job' (restart every rank), or run a script with "
            "`lockstep launch --max-restarts N --restart-policy rank`"
        )
    if restart_policy != "job":
        raise ValueError(f"restart_policy must be 'job' (restart every rank) or 'rank' (lockstep launch only), not {restart_policy!r}")
    if not (isinstance(monitor_interval, (int, float)) and monitor_interval > 0):
        raise ValueError(f"monitor_interval must be a positive number of seconds, not {monitor_interval!r}")
    template = "[rank ${rank}] " if log_line_prefix_template is None else str(log_line_prefix_template)
    restarts = []
    while True:
        count = len(restarts)
        restart_env = {
            "LOCKSTEP_RESTART_COUNT": str(count),
            "TORCHELASTIC_RESTART_COUNT": str(count),
            "LOCKSTEP_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "LOCKSTEP_RESTART_POLICY": "job",
            "LOCKSTEP_REPLACEMENT": "0",
        }
        try:
            return _launch_once(function, args, n, mp, use_port, master_addr, template, monitor_interval, fail_fast, grace, restart_env)
        except RankError as e:
            restarts.append(f"rank {e.rank} ({str(e).splitlines()[0]})")
            if count >= max_restarts:
                if max_restarts:
                    e.args = (f"{e.args[0]}\n\nnotebook_launcher gave up: {count} of {max_restarts} restart(s) used:\n"
                              + "\n".join(f"  restart {k + 1}: {why}" for k, why in enumerate(restarts[:-1])),)
                raise
            _write_console(sys.stderr, f"lockstep: {restarts[-1]}: every rank was stopped; starting them all again "
                                       f"(restart {count + 1} of {max_restarts})\n")


def _write_console(stream, text):
    try:
        stream.write(text)
        stream.flush()
    except Exception:
        pass


def _launch_once(function, args, n, mp, use_port, master_addr, template, monitor_interval, fail_fast, grace, restart_env):
    """One attempt of :func:`notebook_launcher`: fork the ranks with a new segment, supervise
    them, and return their values or raise :class:`RankError`."""
    check_fork_safe()

    env = {
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "MASTER_ADDR": str(master_addr),
        "MASTER_PORT": str(use_port),
        "ACCELERATE_MIXED_PRECISION": mp,
        **restart_env,
    }
    # Buffered output would otherwise be written once by the caller and once by every rank.
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    job = _native.ShmJob(n)
    ranks = []
    first = None
    parent = os.getpid()
    # With torch imported here, each rank starts with torch.distributed initialised on the lockstep
    # backend; its store (torch needs one, for new_group too) is a file in a private directory.
    torch_dir = tempfile.mkdtemp(prefix="lockstep-torch-") if _torch_distributed_wanted() else None
    try:
        for r in range(n):
            pipes = []
            try:
                for _ in range(3):
                    pipes.extend(os.pipe())
                with warnings.catch_warnings():
                    # Python 3.12+ warns about forking a multi-threaded process (a notebook kernel
                    # has several threads): the ranks run only the user's function and the
                    # library, never relying on the kernel's other threads.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
            except BaseException:
                for fd in pipes:
                    os.close(fd)
                raise
            if pid == 0:
                others = [fd for rk in ranks for fd in rk.fds()]
                rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r))
                _rank_main(r, job, function, tuple(args), pipes, others, parent, rank_env, torch_dir)
            out_r, out_w, err_r, err_w, res_r, res_w = pipes
            try:
                # The child does the same; whichever runs first wins, so the group exists before
                # any signal is sent to it.
                os.setpgid(pid, pid)
            except OSError:
                pass
            for fd in (out_w, err_w, res_w):
                os.close(fd)
            ranks.append(_Rank(r, pid, out_r, err_r, res_r))
        job.close()
        prefixes = [template.replace("${rank}", str(r)).replace("${local_rank}", str(r)).replace("${role_name}", "default") for r in range(n)]
        first = _supervise(ranks, prefixes, float(monitor_interval), fail_fast, float(grace))
    except BaseException:
        _hard_stop(ranks, float(grace))
        raise
    finally:
        job.close()
        if torch_dir is not None:
            shutil.rmtree(torch_dir, ignore_errors=True)
        for rk in ranks:
            for fd in rk.fds():
                try:
                    os.close(fd)
                except OSError:
                    pass
    return _collect(ranks, first)


def _torch_distributed_wanted():
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.distributed.is_available())
    except Exception:
        return False


def _init_torch(rank, world, torch_dir):
    """Initialise torch.distributed's default group on the lockstep backend in this rank."""
    import torch.distributed as dist

    from . import torch as _backend  # noqa: F401  (registers the backend)

    store = dist.FileStore(os.path.join(torch_dir, "store"), world)
    dist.init_process_group(_backend.BACKEND, store=store, rank=rank, world_size=world)


def _rank_main(rank, job, function, args, pipes, others, parent, env, torch_dir):
    """The forked rank: set up, run ``function``, send the outcome, ``os._exit``. Never returns."""
    global _COMM, _IN_RANK
    code = 70
    try:
        out_r, out_w, err_r, err_w, res_r, res_w = pipes
        for fd in others + [out_r, err_r, res_r]:
            os.close(fd)
        # Own process group: the terminal's Ctrl-C reaches the caller, which stops the ranks.
        os.setpgid(0, 0)
        if not _native.die_with_parent(parent):
            os._exit(70)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        # The caller's sys.stdout may be a notebook's stream, which does not work in a forked
        # child: the rank writes to its own descriptors, which the caller forwards.
        sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(env)
        _IN_RANK = True
        outcome = None
        try:
            _COMM = job.communicator(rank)
            if torch_dir is not None:
                _init_torch(rank, _COMM.world_size, torch_dir)
            outcome = ("ok", function(*args))
        except SystemExit as e:
            if e.code is None or e.code == 0:
                outcome = ("ok", None)
            else:
                outcome = _error_outcome(e)
        except BaseException as e:
            outcome = _error_outcome(e)
        try:
            data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:
            why = f"rank {rank} returned a {type(outcome[1]).__name__} that cannot be pickled to send back: {type(e).__name__}: {e}"
            data = pickle.dumps(("err", "PicklingError", why, why + "\n", None, None))
            outcome = ("err",)
        view = memoryview(data)
        while view:
            view = view[os.write(res_w, view):]
        os.close(res_w)
        code = 0 if outcome[0] == "ok" else 1
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        try:
            if _COMM is not None:
                _COMM.close()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code)


def _error_outcome(e):
    tb = e.__traceback__
    # Start the traceback at the user's function, not at the launcher's call of it.
    if tb is not None and tb.tb_frame.f_code is _rank_main.__code__ and tb.tb_next is not None:
        tb = tb.tb_next
    tb = "".join(traceback.format_exception(type(e), e, tb))
    try:
        blob = pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        blob = None
    follows = getattr(e, "follows", None) if isinstance(e, _native.CommError) else None
    return ("err", type(e).__qualname__, str(e), tb, blob, follows if isinstance(follows, int) else None)


def _killpg(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_rank(rk, sig):
    """Signal the rank's process group, and the rank itself while it has not been reaped (in
    case it never got its own group)."""
    _killpg(rk.pid, sig)
    if rk.status is None:
        try:
            os.kill(rk.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(rk, block=False):
    """Record the rank's exit status if it has exited."""
    if rk.status is not None:
        return
    try:
        pid, st = os.waitpid(rk.pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        # Reaped already (an interrupted earlier wait): its status is lost.
        rk.status, rk.reaped_at = -signal.SIGKILL, time.monotonic()
        return
    if pid == rk.pid:
        rk.status = os.waitstatus_to_exitcode(st)
        rk.reaped_at = time.monotonic()


# How long a stop after a failure waits for the live ranks to write their flight recorders
# (LOCKSTEP_TRACE_DIR set) before it terminates them, as `lockstep launch` does.
_TRACE_WAIT = 1.0


def _file_id(path):
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _ask_for_traces(ranks, first):
    """With LOCKSTEP_TRACE_DIR set, SIGUSR1 to every live rank but `first`: a rank that was
    computing, in no call, when a peer failed writes its flight recorder only when asked, and its
    record shows where it was. Returns (deadline, [(rank, its world trace file, the file's id
    then)]): a dump replaces the file, so a new inode means the rank has written. None when the
    variable is unset (the ranks have no SIGUSR1 handler then: the signal would kill them)."""
    d = os.environ.get("LOCKSTEP_TRACE_DIR", "")
    if not d:
        return None
    files = []
    for rk in ranks:
        if rk.status is None and rk is not first:
            f = os.path.join(d, f"rank{rk.rank:05d}.jsonl")
            files.append((rk, f, _file_id(f)))
            rk.stopped = True  # its end is the launcher's doing from here on
            try:
                os.kill(rk.pid, signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass
    return time.monotonic() + _TRACE_WAIT, files


def _temp_writer(name):
    """The writer's pid in the name of one of lockstep's temporaries (``.{target}.tmp-{pid}-{random}``),
    or None."""
    if not name.startswith(".") or ".tmp-" not in name:
        return None
    pid = name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
    return int(pid) if pid.isdigit() and int(pid) > 0 else None


def _trace_writers(d):
    try:
        return {_temp_writer(n) for n in os.listdir(d)}
    except OSError:
        return set()


def _traces_written(asked):
    """Every rank asked has written its file (and is writing no other: one that had just written
    its own failure's record writes again) or exited, or the wait is over."""
    deadline, files = asked
    if time.monotonic() >= deadline:
        return True
    writing = _trace_writers(os.path.dirname(files[0][1])) if files else set()
    return all(rk.status is not None or (_file_id(f) not in (None, before) and rk.pid not in writing) for rk, f, before in files)


def _remove_trace_temps(ranks):
    """The temporaries that ranks killed while they wrote their flight recorders left in
    LOCKSTEP_TRACE_DIR (every rank has exited): regular files of this user, named by our writers."""
    d = os.environ.get("LOCKSTEP_TRACE_DIR", "")
    if not d:
        return
    pids = {rk.pid for rk in ranks}
    try:
        names = os.listdir(d)
    except OSError:
        return
    for n in names:
        if _temp_writer(n) in pids:
            path = os.path.join(d, n)
            try:
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    os.unlink(path)
            except OSError:
                pass


def _supervise(ranks, prefixes, interval, fail_fast, grace):
    """Forward output, collect outcomes and exit statuses until every rank is done."""
    sel = selectors.DefaultSelector()
    try:
        for rk in ranks:
            for fd in rk.fds():
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ, rk)
        first = None
        kill_at = None
        traces = None  # the flight recorders asked for before the stop (_ask_for_traces)
        while True:
            now = time.monotonic()
            for rk in ranks:
                if rk.status is None:
                    _reap(rk)
                    if rk.status is not None:
                        # The rank is gone: whatever it started goes too, so nothing is left
                        # behind and its pipes reach end of file.
                        _killpg(rk.pid, signal.SIGKILL)
            stop = False
            if first is None:
                first = next((rk for rk in ranks if rk.failed()), None)
                if first is not None and fail_fast:
                    traces = _ask_for_traces(ranks, first)
                    stop = traces is None
            if traces is not None and _traces_written(traces):
                traces, stop = None, True
            if stop:
                for rk in ranks:
                    if rk.status is None and rk is not first:
                        rk.stopped = True
                        _signal_rank(rk, signal.SIGTERM)
                kill_at = now + grace
            if kill_at is not None and now >= kill_at:
                for rk in ranks:
                    if rk.status is None:
                        _signal_rank(rk, signal.SIGKILL)
                kill_at = None
            for rk in ranks:
                # A grandchild that escaped the process group may hold a pipe open: give up on it
                # a second after the rank exited.
                if rk.reaped_at is not None and now - rk.reaped_at > 1.0:
                    for fd in list(rk.streams):
                        _eof(sel, rk, fd, prefixes[rk.rank])
            if all(rk.status is not None and not rk.streams for rk in ranks):
                if any(rk.stopped for rk in ranks):
                    _remove_trace_temps(ranks)
                return first
            for key, _ in sel.select(timeout=interval if traces is None else min(interval, 0.01)):
                _read(sel, key.data, key.fd, prefixes[key.data.rank])
            _flush()
    finally:
        sel.close()


def _read(sel, rk, fd, prefix):
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        return
    except OSError:
        chunk = b""
    if not chunk:
        _eof(sel, rk, fd, prefix)
        return
    kind = rk.streams[fd]
    if kind == "res":
        rk.result += chunk
        return
    data = rk.partial[kind] + chunk
    *lines, rk.partial[kind] = data.split(b"\n")
    for line in lines:
        _emit(rk, kind, prefix, line)


def _eof(sel, rk, fd, prefix):
    kind = rk.streams.pop(fd, None)
    if kind is None:
        return
    try:
        sel.unregister(fd)
    except (KeyError, ValueError):
        pass
    os.close(fd)
    if kind == "res":
        rk.result_done = True
        if rk.result:
            try:
                rk.outcome = pickle.loads(bytes(rk.result))
            except BaseException as e:
                why = f"the result sent back could not be unpickled here: {type(e).__name__}: {e}"
                # The same six fields as a rank's own error outcome (no pickled exception, no
                # rank it follows), so _collect reads every error alike.
                rk.outcome = ("err", "UnpicklingError", why, why + "\n", None, None)
        return
    if rk.partial[kind]:
        _emit(rk, kind, prefix, rk.partial[kind])
        rk.partial[kind] = b""


def _emit(rk, kind, prefix, line):
    text = line.decode("utf-8", "replace").rstrip("\r")
    if kind == "err":
        rk.err_tail.append(text)
    stream = sys.stderr if kind == "err" else sys.stdout
    try:
        stream.write(f"{prefix}{text}\n")
    except Exception:
        pass


def _flush():
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass


def _hard_stop(ranks, grace):
    """Stop every rank (and what it started) and reap it, whatever interrupts us meanwhile."""
    live = [rk for rk in ranks if rk.status is None]
    try:
        for rk in live:
            rk.stopped = True
            _signal_rank(rk, signal.SIGTERM)
        deadline = time.monotonic() + min(grace, 1.0)
        while any(rk.status is None for rk in live) and time.monotonic() < deadline:
            for rk in live:
                _reap(rk)
            time.sleep(0.01)
    except BaseException:
        pass
    while True:
        try:
            for rk in ranks:
                _signal_rank(rk, signal.SIGKILL)
            for rk in ranks:
                _reap(rk, block=True)
            return
        except KeyboardInterrupt:
            continue


def _describe_exit(rk):
    if rk.status is None:
        return "did not exit"
    if rk.status < 0:
        sig = -rk.status
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "signal"
        how = f"was killed by signal {sig} ({name})"
    else:
        how = f"exited with code {rk.status}"
    return how


def _collect(ranks, first):
    """Return the values in rank order, or raise RankError for ``first`` (the first rank seen
    failing; otherwise the lowest failed rank not stopped by the launcher)."""
    failures = {}
    own = set()  # ranks that failed by themselves (not stopped by the launcher)
    for rk in ranks:
        if rk.status == 0 and rk.outcome is not None and rk.outcome[0] == "ok":
            continue
        if rk.outcome is not None and rk.outcome[0] == "err":
            etype, msg = rk.outcome[1:3]
            failures[rk.rank] = f"{etype}: {msg}" if msg else etype
            own.add(rk.rank)
        elif rk.stopped and first is not None and rk is not first:
            failures[rk.rank] = f"stopped by notebook_launcher after rank {first.rank} failed ({_describe_exit(rk)})"
        else:
            desc = f"{_describe_exit(rk)} without sending a result"
            if rk.err_tail:
                desc += "; last lines of its stderr:\n    " + "\n    ".join(rk.err_tail)
            failures[rk.rank] = desc
            own.add(rk.rank)
        if first is None or (first.stopped and not rk.stopped):
            first = rk
    if first is None:
        return [rk.outcome[1] for rk in ranks]
    # A rank whose error only reports another rank's failure (a lost peer, an abort) reaches the
    # caller at about the moment that rank's own outcome does, often first: report the rank it
    # names when that rank failed by itself, following the chain (at most once per rank).
    for _ in ranks:
        follows = first.outcome[5] if first.outcome is not None and first.outcome[0] == "err" else None
        cause = ranks[follows] if isinstance(follows, int) and 0 <= follows < len(ranks) else None
        if cause is None or cause is first or cause.rank not in own:
            break
        first = cause
    n = len(ranks)
    cause = None
    if first.outcome is not None and first.outcome[0] == "err":
        etype, _msg, tb, blob = first.outcome[1:5]
        message = f"rank {first.rank} of {n} failed: {failures[first.rank]}\n\nTraceback of rank {first.rank}:\n{tb.rstrip()}"
        if blob is not None:
            try:
                cause = pickle.loads(blob)
            except BaseException:
                cause = None
    else:
        etype, tb = None, ""
        message = f"rank {first.rank} of {n} {failures[first.rank]}"
    others = {r: d for r, d in failures.items() if r != first.rank}
    if others:
        message += "\n\nOther ranks:\n" + "\n".join(f"  rank {r}: {d.splitlines()[0]}" for r, d in sorted(others.items()))
    err = RankError(message, first.rank, etype, tb, failures)
    if cause is not None:
        raise err from cause
    raise err
