#!/usr/bin/env bash
# Start-up benchmark of the CLI launcher: whole-process wall time (median and p90 of RUNS runs,
# after 3 warm-ups) and CPU time (median of user + system time of the launcher and every process
# it waited for: guards and ranks, from wait4) of
#   lockstep launch --nproc-per-node N -- lockstep selftest
# for N = 2 (target <= 5 ms) and N = 8 (target <= 10 ms; issue 16): every rank execs the program,
# joins the named segment, runs one verified all-reduce and a barrier. Then the launcher's floor
# (ranks running `true`), the ranks starting the executable alone (`lockstep --version`), and
# mpirun / torchrun when they are installed. CPU time does not depend on what else runs on the machine the way wall time
# does: on the 2-CPU project machine other jobs move wall times by several times, so the load
# average is printed before and after.
#
# Usage: benches/baselines/startup.sh [path/to/lockstep]   (default: target/release/lockstep,
#        built with `cargo build --release` if missing). RUNS=20 by default. Needs python3.
# Reference numbers seen on the project machine are in startup.md beside this script.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${1:-$PWD/target/release/lockstep}"
RUNS="${RUNS:-20}"
if [[ ! -x "$BIN" ]]; then
  cargo build --release --bin lockstep >&2
fi
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"

# measure CMD...: run CMD 3 + $RUNS times; print "median p90 cpu" in ms, or "failed".
measure() {
  python3 benches/baselines/startup_ab.py --once "$RUNS" "$@"
}

report() { # name target_ms "median p90 cpu"
  local verdict="" med p90 cpu
  read -r med p90 cpu <<<"$3"
  if [[ -n "$2" && "$med" != failed ]]; then
    verdict=$(awk -v m="$med" -v t="$2" 'BEGIN { print (m <= t) ? "ok (target <= " t " ms)" : "SLOW (target <= " t " ms)" }')
  fi
  printf '%-66s median %7s ms  p90 %7s ms  cpu %7s ms  %s\n' "$1" "$med" "${p90:-}" "${cpu:-}" "$verdict"
}

echo "start-up, median and p90 of $RUNS runs, $(nproc) CPUs, $(uname -r), load average $(cut -d' ' -f1-3 /proc/loadavg)"
report "lockstep launch --nproc-per-node 2 -- lockstep selftest" 5 "$(measure "$BIN" launch --nproc-per-node 2 -- "$BIN" selftest)"
report "lockstep launch --nproc-per-node 8 -- lockstep selftest" 10 "$(measure "$BIN" launch --nproc-per-node 8 -- "$BIN" selftest)"
report "(floor) lockstep launch --nproc-per-node 2 -- true" "" "$(measure "$BIN" launch --nproc-per-node 2 -- true)"
report "(floor) lockstep launch --nproc-per-node 8 -- true" "" "$(measure "$BIN" launch --nproc-per-node 8 -- true)"
# The ranks start and leave the lockstep executable itself, without joining: between `true` and
# this lies the cost of starting the executable, between this and selftest what joining and the
# collectives add.
report "(binary) lockstep launch --nproc-per-node 2 -- lockstep --version" "" "$(measure "$BIN" launch --nproc-per-node 2 -- "$BIN" --version)"
report "(binary) lockstep launch --nproc-per-node 8 -- lockstep --version" "" "$(measure "$BIN" launch --nproc-per-node 8 -- "$BIN" --version)"

if command -v mpirun >/dev/null; then
  # Open MPI refuses root without these.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  report "mpirun -np 2 true" "" "$(measure mpirun --oversubscribe -np 2 true)"
  report "mpirun -np 8 true" "" "$(measure mpirun --oversubscribe -np 8 true)"
else
  echo "mpirun: not installed (skipped)"
fi
if command -v torchrun >/dev/null; then
  report "torchrun --nproc-per-node 2 --no-python true" "" "$(measure torchrun --nproc-per-node 2 --no-python true)"
else
  echo "torchrun: not installed (skipped)"
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
