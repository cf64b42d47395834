#!/usr/bin/env python3
"""Run `lockstep bench` and each available baseline back to back, beside the machine's bound and
cache-placement state, and print ratios in one markdown table per state.

Usage: python3 benches/baselines/compare.py [--nprocs 2] [--sizes 8,1048576,67108864] [--rounds 3]
           [--ops all_reduce,broadcast,all_gather,reduce_scatter] [--until-both-states]
           [--max-minutes 30] [--threshold-ns 250] [--buffers ordinary,shared] [--in-place]
           [--before PATH]

--buffers picks lockstep's buffer kinds (default both). --in-place adds lockstep's in-place times
(the same runs' in-place columns) as tools "... in place": MPI_Bcast is in place by its API, so
that is the like-for-like broadcast. --before PATH runs a second lockstep binary (e.g. the main
branch's) on ordinary buffers in the same rounds, alternating with the others, as "before/...".

Baselines: Open MPI (benches/baselines/mpi_bench.c, built with mpicc when present) and
torch.distributed gloo (benches/baselines/gloo_bench.py, when torch imports). Each round runs,
per op, every tool once, alternating, then the bound, with a state probe before and after; the
median time over the rounds of one state is compared, since this machine's memory bandwidth and
core placement drift over minutes.

Machine state (benches/baselines/c2c.c): two threads pinned to CPU 0 and CPU 1 ping-pong a cache
line; p10 of 50 batch means, in ns per round trip. The hypervisor places the two vCPUs on cores
that share an L3 or on cores that do not, and changes that within minutes. Threshold
(--threshold-ns 250), from 312 probes over 35 minutes on the project machine (2026-11-22/23, one
every ~6 s, load average 6-10 from other builds): the shared-cache state gave p10 = 44-238 ns
(median 129; two probes near 44 ns, both vCPUs on one core's SMT threads; the three above 200 ns
were lone probes between ~120 ns neighbours, i.e. interference, not a state). The other state
did not occur during those 35 minutes; it costs 2-5x the shared-cache latency (issue 16; session
2 saw Open MPI's 8 B all-reduce go from 0.22 to 0.44 us), i.e. at least ~2 x 129 = 260 ns. 250 ns
lies between the highest shared-cache probe and that. Check it against the probe values this
script prints once the other state shows up. A round whose probes before and after disagree is
labelled "changed" and reported apart.

Bound (benches/baselines/membw.c, `membw NPROCS X`): NPROCS threads pinned to CPUs 0..NPROCS-1
each memcpy X bytes at the same moment; the bound is the median time of that, X chosen so each
core moves the least memory traffic the collective needs (reads + writes of all ranks, spread
evenly over the cores; a copy of X bytes reads X and writes X). For n ranks and size S as
`lockstep bench` counts it (f32 sum):
  all_reduce S        every input read once (n*S), every output written once (n*S):   X = S
                      (on shared buffers: each rank reads its 1/n of every input and writes its
                      1/n of every output, i.e. n concurrent copies of S)
  broadcast S         out of place: the root's S read once, n outputs of S written (the root's
                      own output too):                                               X = S(n+1)/(2n)
                      in place (the "in place" columns, and MPI_Bcast): (n-1) written: X = S/2
  all_gather S        S = output bytes; n inputs of S/n read once (S), n outputs of S: X = S(n+1)/(2n)
  reduce_scatter S    S = input bytes; n inputs of S read once, n outputs of S/n:      X = S(n+1)/(2n)
  all_to_all S        every input byte read once, every output byte written once:      X = S
  pingpong S          one-way time of one message of S: S read, S written:             X = S/2
At sizes whose copies fit in cache (1 MiB: 2 MiB per core), the copies run from cache, so the
bound is the cache's and stricter than what any transfer between cores can reach.
Any collective also moves at least one cache line from one core to another, so the bound is
never below half the probe's round trip: bound = max(copy time, rtt/2). "x bound" = bound time /
lockstep time (1.0 = at the bound); "x MPI" = Open MPI time / lockstep time (> 1: lockstep faster).
The bound is measured only when NPROCS <= the CPUs of this machine.

Ordinary-buffer floor of all_gather, broadcast and all_reduce (benches/baselines/cma_floor.c, 2
ranks, 64 KiB-4 MiB): on ordinary (private) buffers out of place, every byte of a peer's block
reaches this rank's output either through a shared mapping (the peer copies it in, this rank
copies it out) or through the kernel (process_vm_readv/writev), and each rank (a broadcast's root)
also copies its own block into its output. Each op-round times those copies done by two bare
processes with nothing else, in every arrangement lockstep could use. all_gather: staged (stage,
then own copy and copy-out; own copy first; stage and own copy fused into one pass), single-copy
(own copy and a pull, or a push). broadcast: staged (the root stages, then copies its own output
while the receiver copies out; stage and own copy fused), single-copy (the receiver pulls all;
the root pushes a quarter; each moves a half). Open MPI's broadcast is in place, so for broadcast
the column says how far an out-of-place broadcast on ordinary buffers could get ahead of it.
With --in-place, the "in-place floor" does the same for the in-place forms, where a rank's own
block already lies in its output: all_gather pushes or pulls the peer's block through the kernel,
or stages its own block and copies the peer's out; broadcast's receiver pulls all, or the root
pushes half and the receiver pulls half, or the root stages and the receiver copies out.
all_reduce: staged as lockstep's (each stages the half its peer reduces, reduces its own half
into its output and a second slot, then copies the peer's result out), the f32 sums included;
only that arrangement so far: lockstep's single copy through the kernel has no variant in
cma_floor yet, so where the tuner picks it lockstep can run below this "floor".
The "ordinary floor" is the fastest of them
(median per variant, then the least), and "MPI / floor" = Open MPI's time / that floor: the most
"x MPI" any implementation on ordinary buffers could show in that run (below 2: issue 16's 2x at
that size cannot be met on ordinary buffers out of place). Staging in cma_floor alternates two
slots as lockstep's phases do.

Tail latency: for sizes up to 4 KiB a second table per state gives p50 / p99 per call (each the
slowest rank's, median over the rounds) for lockstep (`lockstep bench --format csv`) and Open MPI
(mpi_bench.c's ninth column); gloo_bench.py reports no p99.

Floors per call (benches/baselines/xfloor.c, 2 ranks, sizes up to 4 KiB): each op-round also times
bare protocols on CPUs 0 and 1 with the same per-call clock reads: "exchange" (every rank
hears from its peer in every call, what lockstep's same-call argument check needs), "eager" (a
broadcast root that writes into a ring and returns, as Open MPI's does), "clock" (the clock
reads alone) and "own" (the exchange plus a read of the rank's own line after it: the extra
crossing that lockstep's fast path avoids). The medians per state follow the tail table.
"""
import argparse, os, re, shutil, statistics, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHARED, NOT_SHARED, CHANGED = "shared cache", "no shared cache", "changed"
# Sizes whose p50 / p99 get their own table.
P99_MAX_BYTES = 4096
# Sizes that get the ordinary-buffer floor, and cma_floor's variants per op (letters as its ONLY=
# takes them). all_gather out of place: pull, push, staged, own copy first, fused. broadcast out of
# place: pull, split, halves, halves in chunks, staged, staged and fused. all_reduce out of place:
# staged (stage the peer's half, reduce the own half, copy the peer's result out).
OFLOOR_BYTES = (64 << 10, 4 << 20)
OFLOOR_VARIANTS = {"all_gather": "histu", "broadcast": "defgvw", "all_reduce": "z"}
# In place (with --in-place): all_gather push, pull, staged; broadcast pull, split, staged.
IFLOOR_VARIANTS = {"all_gather": "joA", "broadcast": "bcB"}
# The floor columns: name, Open MPI's ratio column, variants per op, whether only with --in-place.
FLOOR_KINDS = (("ordinary floor", "MPI / floor", OFLOOR_VARIANTS, False),
               ("in-place floor", "MPI / in-place floor", IFLOOR_VARIANTS, True))


def parse(out):
    """size -> (time, busbw, wrong, p99) out of place, and size -> the same in place (lockstep
    only). p99 is None where the tool does not report it (gloo_bench.py)."""
    rows, in_place = {}, {}
    num = lambda x: float(x) if x else None
    for line in out.splitlines():
        f = line.split()
        c = line.strip().split(",")
        # lockstep bench --format csv: op,ranks,size_bytes,count,type,redop,root, then time algbw
        # busbw wrong out of place and in place, then the p99s (out of place, in place).
        if len(c) == 17 and c[2].isdigit():
            size = int(c[2])
            rows[size] = (float(c[7]), float(c[9]), int(c[10] or 0), num(c[15]))
            if c[11]:
                in_place[size] = (float(c[11]), float(c[13]), int(c[14] or 0), num(c[16]))
        # lockstep bench's text: nccl-tests' 13 columns (a --before binary without p99 in csv).
        elif len(f) == 13 and f[0].isdigit():
            rows[int(f[0])] = (float(f[5]), float(f[7]), int(f[8]), None)
            if f[9] != "N/A":
                in_place[int(f[0])] = (float(f[9]), float(f[11]), int(f[12]) if f[12].isdigit() else 0, None)
        # The baselines: size count type op time algbw busbw #wrong [p99].
        elif len(f) in (8, 9) and f[0].isdigit():
            rows[int(f[0])] = (float(f[4]), float(f[6]), int(f[7]), float(f[8]) if len(f) == 9 else None)
    return rows, in_place


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


def build_c(src, exe, *flags):
    """Compile one of the C helpers beside this script into /tmp (once per run)."""
    subprocess.run(["gcc", "-O2", *flags, "-o", exe, os.path.join(HERE, src)], check=True)
    return exe


def probe(c2c):
    """ns per round trip of a cache line between CPU 0 and CPU 1 (p10 of 50 batches)."""
    m = re.search(r"p10=([0-9.]+)", run([c2c, "0", "1", "50"]))
    return float(m.group(1))


def copy_bytes(op, size, n, in_place=False):
    """X of the docstring: each core copies X bytes for the collective's least traffic."""
    if op in ("all_reduce", "all_to_all"):
        return size
    if op == "pingpong" or (op == "broadcast" and in_place):
        return size // 2
    if op in ("all_gather", "reduce_scatter", "broadcast"):
        return size * (n + 1) // (2 * n)
    return None


def copies_us(membw, threads, x):
    m = re.search(r"median_us ([0-9.]+)", run([membw, str(threads), str(x)]))
    return float(m.group(1))


def fmt_us(t):
    if t >= 10000:
        return f"{t / 1000:.2f} ms"
    return f"{t:.2f} µs" if t < 10 else f"{t:.1f} µs"


def fmt_size(b):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k and b % k == 0:
            return f"{b // k} {unit}"
    return f"{b} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--sizes", default="8,1048576,67108864")
    ap.add_argument("--ops", default="all_reduce,broadcast,all_gather,reduce_scatter")
    ap.add_argument("--rounds", type=int, default=3, help="rounds to run at least")
    ap.add_argument("--until-both-states", action="store_true",
                    help="after --rounds, go on until a whole round was seen in each state (see --max-minutes)")
    ap.add_argument("--max-minutes", type=float, default=30.0, help="time cap of --until-both-states")
    ap.add_argument("--threshold-ns", type=float, default=250.0,
                    help="probe round trip below which the two CPUs count as sharing a cache")
    ap.add_argument("--lockstep", default=os.path.join(ROOT, "target", "release", "lockstep"),
                    help="the lockstep binary (default: target/release/lockstep, built when missing)")
    ap.add_argument("--buffers", default="ordinary,shared", help="lockstep's buffer kinds to run")
    ap.add_argument("--in-place", action="store_true", help="also report lockstep's in-place times")
    ap.add_argument("--before", help="a second lockstep binary to run on ordinary buffers in the same rounds")
    a = ap.parse_args()
    t_start = time.monotonic()
    ops = a.ops.split(",")
    sizes = [int(s) for s in a.sizes.split(",")]
    lockstep = a.lockstep
    if not os.path.exists(lockstep):
        subprocess.run(["cargo", "build", "--release", "--bin", "lockstep"], cwd=ROOT, check=True)
    c2c = build_c("c2c.c", "/tmp/lockstep_c2c", "-pthread")
    cpus = os.cpu_count() or 1
    membw = build_c("membw.c", "/tmp/lockstep_membw", "-mavx512f", "-pthread") if a.nprocs <= cpus else None
    if membw is None:
        print(f"# {a.nprocs} ranks on {cpus} CPUs: no bound (one copier per rank needs a CPU each)")
    xfloor = build_c("xfloor.c", "/tmp/lockstep_xfloor", "-pthread") if a.nprocs == 2 and cpus >= 2 else None
    cma_floor = build_c("cma_floor.c", "/tmp/lockstep_cma_floor", "-mavx2") if a.nprocs == 2 and cpus >= 2 else None
    tools = {}
    def same_statistic(exe):
        # The tables compare the slowest rank's median per call (as mpi_bench.c reports); a
        # lockstep that reports nccl-tests' mean averaged over ranks by default is asked for it.
        help_text = subprocess.run([exe, "bench", "--help"], capture_output=True, text=True).stdout
        return ["--stat", "median", "-a", "3"] if "--stat" in help_text else []

    bench = lambda exe, b: (lambda extra: lambda op: [exe, "bench", "--nprocs", str(a.nprocs), "--op", op, "--sizes", a.sizes, "--buffers", b, "--format", "csv", *extra])(same_statistic(exe))
    if a.before:
        tools["before/ordinary"] = bench(a.before, "ordinary")
    for buffers in a.buffers.split(","):
        tools[f"lockstep/{buffers}"] = bench(lockstep, buffers)
    if shutil.which("mpicc") and shutil.which("mpirun"):
        exe = "/tmp/lockstep_mpi_bench"
        subprocess.run(["mpicc", "-O2", "-o", exe, os.path.join(HERE, "mpi_bench.c")], check=True)
        extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        tools["openmpi"] = lambda op: ["mpirun", *extra, "--oversubscribe", "-np", str(a.nprocs), exe, op, a.sizes]
    else:
        print("# Open MPI not found (apt-get install openmpi-bin libopenmpi-dev): skipped")
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0:
        tools["gloo"] = lambda op: [sys.executable, os.path.join(HERE, "gloo_bench.py"), "--nprocs", str(a.nprocs), "--op", op, "--sizes", a.sizes]
    else:
        print("# torch not importable: gloo baseline skipped")

    def state_of(ns):
        return SHARED if ns < a.threshold_ns else NOT_SHARED

    # (state, op, tool, size) -> [(time, busbw, wrong)]; (state, op, size) -> [bound us]
    results, bounds, probes = {}, {}, {}
    floors = {}  # (state, protocol) -> [ns per call]
    ofloors = {}  # (kind, state, op, size) -> [us: the fastest ordinary-buffer arrangement]
    seen_rounds = {}  # state -> number of (round, op) blocks
    rnd = 0
    while True:
        both = all(seen_rounds.get(s, 0) >= len(ops) for s in (SHARED, NOT_SHARED))
        if rnd >= a.rounds and (not a.until_both_states or both):
            break
        if rnd >= a.rounds and time.monotonic() - t_start > a.max_minutes * 60:
            print(f"# time cap of {a.max_minutes} min reached before both states were seen")
            break
        rnd += 1
        for op in ops:
            before = probe(c2c)
            block = {}
            for name, cmd in tools.items():
                rows, in_place = parse(run(cmd(op)))
                for size, v in rows.items():
                    block.setdefault((name, size), []).append(v)
                for size, v in in_place.items() if a.in_place else ():
                    block.setdefault((f"{name} in place", size), []).append(v)
            bound, bound_ip = {}, {}
            for size in sizes:
                x = copy_bytes(op, size, a.nprocs)
                if membw is not None and x is not None:
                    bound[size] = copies_us(membw, a.nprocs, x)
                # Only broadcast's least traffic differs in place (the root writes no output).
                xi = copy_bytes(op, size, a.nprocs, in_place=True)
                if a.in_place and membw is not None and xi is not None and xi != x:
                    bound_ip[size] = copies_us(membw, a.nprocs, xi)
            floor = {}
            if xfloor is not None and any(z <= P99_MAX_BYTES for z in sizes):
                floor = {m[0]: float(m[1]) for m in re.findall(r"xfloor (\w+) median_ns=([0-9.]+)", run([xfloor, "500000"]))}
            ofloor = {}  # (kind, size) -> us
            for size in sizes:
                for kind, _, variants, in_place_only in FLOOR_KINDS:
                    if (a.in_place or not in_place_only) and op in variants and cma_floor is not None \
                            and OFLOOR_BYTES[0] <= size <= OFLOOR_BYTES[1]:
                        out = subprocess.run([cma_floor, str(size), "100", "3"], capture_output=True, text=True, check=True,
                                             env={**os.environ, "ONLY": variants[op]}).stdout
                        ofloor[kind, size] = min(float(m) for m in re.findall(r"median_us\s+([0-9.]+)", out))
            after = probe(c2c)
            s0, s1 = state_of(before), state_of(after)
            state = s0 if s0 == s1 else CHANGED
            fl = "".join(f", {p} {ns:.0f} ns" for p, ns in floor.items() if p != "clock")
            print(f"# round {rnd} {op}: probe {before:.0f} -> {after:.0f} ns per round trip: {state}{fl}", flush=True)
            seen_rounds[state] = seen_rounds.get(state, 0) + 1
            probes.setdefault(state, []).extend([before, after])
            for (name, size), vs in block.items():
                results.setdefault((state, op, name, size), []).extend(vs)
            for proto, ns in floor.items():
                floors.setdefault((state, proto), []).append(ns)
            for (kind, size), us in ofloor.items():
                ofloors.setdefault((kind, state, op, size), []).append(us)
            for key, bd in (("", bound), (" in place", bound_ip)):
                for size, t in bd.items():
                    # A collective moves at least one cache line one way: half the round trip.
                    bounds.setdefault((state, op + key, size), []).append(max(t, min(before, after) / 2000.0))

    base = [t for t in tools if not t.startswith(("lockstep", "before"))]
    mine = [t for t in tools if t.startswith(("lockstep", "before"))]
    if a.in_place:
        mine = [m for t in mine for m in (t, f"{t} in place")]
    # Ratio columns name lockstep's tools without the "lockstep/" prefix.
    label = lambda m: m.removeprefix("lockstep/")
    med = lambda vs, i: statistics.median(v[i] for v in vs)
    for state in (SHARED, NOT_SHARED, CHANGED):
        if state not in seen_rounds:
            continue
        ps = probes[state]
        print(f"\n### {state}: {seen_rounds[state]} op-round(s), probe {min(ps):.0f}-{max(ps):.0f} ns per round trip "
              f"({a.nprocs} ranks, f32 sum, median over the rounds; time per call)\n")
        hdr = ["op", "size", *mine, *base, "bound"]
        hdr += [f"{label(m)} x {b}" for m in mine for b in base if b == "openmpi"]
        hdr += [f"{label(m)} x bound" for m in mine]
        kinds = [(k, r) for k, r, _, _ in FLOOR_KINDS if any((k, state) == key[:2] for key in ofloors)]
        for kind, ratio in kinds:
            hdr += [kind] + ([ratio] if "openmpi" in base else [])
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
        for op in ops:
            for size in sizes:
                if not any((state, op, name, size) in results for name in tools):
                    continue  # no round of this op in this state
                row = [op, fmt_size(size)]
                t = {}
                for name in mine + base:
                    vs = results.get((state, op, name, size))
                    if vs:
                        t[name] = med(vs, 0)
                        wrong = max(v[2] for v in vs)
                        row.append(fmt_us(t[name]) + (f" ({wrong} wrong!)" if wrong else ""))
                    else:
                        row.append("—")
                bs = bounds.get((state, op, size))
                bt = statistics.median(bs) if bs else None
                bs_ip = bounds.get((state, op + " in place", size))
                bt_ip = statistics.median(bs_ip) if bs_ip else bt
                row.append((fmt_us(bt) if bt else "—") + (f" ({fmt_us(bt_ip)} in place)" if bs_ip else ""))
                for m in mine:
                    if "openmpi" in base:
                        row.append(f"{t['openmpi'] / t[m]:.2f}" if m in t and "openmpi" in t else "—")
                for m in mine:
                    b = bt_ip if m.endswith(" in place") else bt
                    row.append(f"{b / t[m]:.2f}" if m in t and b else "—")
                for kind, _ in kinds:
                    ofs = ofloors.get((kind, state, op, size))
                    of = statistics.median(ofs) if ofs else None
                    row.append(fmt_us(of) if of else "—")
                    if "openmpi" in base:
                        row.append(f"{t['openmpi'] / of:.2f}" if of and "openmpi" in t else "—")
                print("| " + " | ".join(row) + " |")
        small = [z for z in sizes if z <= P99_MAX_BYTES]
        if small:
            # Tail latency where it matters most (issue 16: p99 within 3x of p50): per tool, the
            # median over the rounds of each run's p50 and p99 (slowest rank), and their ratio.
            tails = [m for m in mine + base if any((state, op, m, z) in results for op in ops for z in small)]
            print(f"\n{state}: p50 / p99 per call (p99/p50), sizes up to {fmt_size(P99_MAX_BYTES)}\n")
            hdr = ["op", "size", *tails]
            print("| " + " | ".join(hdr) + " |")
            print("|" + "---|" * len(hdr))
            for op in ops:
                for size in small:
                    if not any((state, op, name, size) in results for name in tails):
                        continue
                    row = [op, fmt_size(size)]
                    for name in tails:
                        vs = [v for v in results.get((state, op, name, size), []) if v[3] is not None]
                        if vs:
                            p50, p99 = med(vs, 0), med(vs, 3)
                            row.append(f"{fmt_us(p50)} / {fmt_us(p99)} ({p99 / p50:.1f})")
                        else:
                            row.append("—")
                    print("| " + " | ".join(row) + " |")
        fl = {p: statistics.median(v) for (st, p), v in floors.items() if st == state}
        if fl:
            print(f"\n{state}: floors per call (xfloor.c, median over the op-rounds): "
                  + ", ".join(f"{p} {fmt_us(ns / 1000.0)}" for p, ns in fl.items()))
    print(f"\n# {rnd} round(s) in {(time.monotonic() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main()
