#!/usr/bin/env bash
# Start-up benchmark of the CLI launcher: whole-process wall time (median and p90 of RUNS runs) of
#   lockstep launch --nproc-per-node N -- lockstep selftest
# for N = 2 (target <= 5 ms) and N = 8 (target <= 10 ms; issue 16), beside torchrun / mpirun when
# they are installed. Uses hyperfine when present (apt-get install -y hyperfine), else a shell
# timing loop. The load average is printed: on the 2-CPU project machine other jobs move these
# figures by several times.
#
# Usage: benches/baselines/startup.sh [path/to/lockstep]   (default: target/release/lockstep,
#        built with `cargo build --release` if missing). RUNS=20 by default.
# Reference numbers seen on the project machine are in startup.md beside this script.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${1:-$PWD/target/release/lockstep}"
RUNS="${RUNS:-20}"
if [[ ! -x "$BIN" ]]; then
  cargo build --release --bin lockstep >&2
fi

# median_ms CMD...: run CMD $RUNS times, print "median p90" of the wall time in ms.
median_ms() {
  if command -v hyperfine >/dev/null; then
    local json
    json="$(mktemp)"
    if ! hyperfine -N --style none --warmup 3 --runs "$RUNS" --export-json "$json" "$*" >/dev/null 2>&1; then
      echo "failed"
      rm -f "$json"
      return
    fi
    python3 -c 'import json,sys; t=sorted(json.load(open(sys.argv[1]))["results"][0]["times"]); n=len(t); print("%.1f %.1f" % ((t[(n-1)//2]+t[n//2])/2e-3, t[min(n-1, round(0.9*n)-1)]*1e3))' "$json"
    rm -f "$json"
  else
    local ts=()
    for _ in $(seq "$RUNS"); do
      local t0 t1
      t0=$(date +%s%N)
      if ! "$@" >/dev/null 2>&1; then
        echo "failed"
        return
      fi
      t1=$(date +%s%N)
      ts+=($(( (t1 - t0) / 1000 )))
    done
    printf '%s\n' "${ts[@]}" | sort -n | awk '{a[NR]=$1} END {p=int(0.9*NR+0.5); if (p<1) p=1; printf "%.1f %.1f\n", (a[int((NR+1)/2)]+a[int(NR/2)+1])/2000, a[p]/1000}'
  fi
}

report() { # name target_ms "median p90"
  local verdict="" med p90
  read -r med p90 <<<"$3"
  if [[ -n "$2" && "$med" != failed ]]; then
    verdict=$(awk -v m="$med" -v t="$2" 'BEGIN { print (m <= t) ? "ok (target <= " t " ms)" : "SLOW (target <= " t " ms)" }')
  fi
  printf '%-52s median %8s ms  p90 %8s ms  %s\n' "$1" "$med" "${p90:-}" "$verdict"
}

echo "start-up, median and p90 of $RUNS runs, $(nproc) CPUs, $(uname -r), load average $(cut -d' ' -f1-3 /proc/loadavg)"
report "lockstep launch --nproc-per-node 2 -- selftest" 5 "$(median_ms "$BIN" launch --nproc-per-node 2 -- "$BIN" selftest)"
report "lockstep launch --nproc-per-node 8 -- selftest" 10 "$(median_ms "$BIN" launch --nproc-per-node 8 -- "$BIN" selftest)"
report "(floor) lockstep launch --nproc-per-node 2 -- true" "" "$(median_ms "$BIN" launch --nproc-per-node 2 -- true)"

if command -v mpirun >/dev/null; then
  # Open MPI refuses root without these.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  report "mpirun -np 2 true" "" "$(median_ms mpirun --oversubscribe -np 2 true)"
  report "mpirun -np 8 true" "" "$(median_ms mpirun --oversubscribe -np 8 true)"
else
  echo "mpirun: not installed (skipped)"
fi
if command -v torchrun >/dev/null; then
  report "torchrun --nproc-per-node 2 --no-python true" "" "$(median_ms torchrun --nproc-per-node 2 --no-python true)"
else
  echo "torchrun: not installed (skipped)"
fi
