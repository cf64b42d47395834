#!/bin/bash
# A/B of the shared-memory backend's staging modes, back to back with Open MPI, in rounds.
#
#   benches/baselines/stage_modes.sh [ROUNDS] [OPS] [SIZES]
#
# Each round runs `lockstep bench` with LOCKSTEP_SHM_STAGE=auto, cached and streaming, then the
# Open MPI baseline, for every op. The machine's vCPUs sometimes share a cache and sometimes not
# (it changes within minutes), so rounds are printed separately: compare within a round.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}
OPS=${2:-"all_reduce broadcast all_gather reduce_scatter"}
SIZES=${3:-1048576,67108864}
L=target/release/lockstep
[ -x $L ] || cargo build --release --bin lockstep
MPI=
if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  MPI=/tmp/lockstep_mpi_bench
  mpicc -O2 -o $MPI benches/baselines/mpi_bench.c
fi
# Size and out-of-place time: lockstep bench prints 13 columns (nccl-tests'), mpi_bench 9 (its
# ninth is the p99).
rows() { grep -v '^#' | awk '$1 ~ /^[0-9]+$/ { if (NF == 13) print $1, $6; else if (NF == 8 || NF == 9) print $1, $5 }'; }
echo "round op size(B) auto cached streaming openmpi (us)"
for r in $(seq "$ROUNDS"); do
  for op in $OPS; do
    declare -A t=()
    for v in auto cached streaming; do
      while read -r size us; do t[$v.$size]=$us; done < <(LOCKSTEP_SHM_STAGE=$v $L bench --nprocs 2 --op "$op" --sizes "$SIZES" | rows)
    done
    if [ -n "$MPI" ]; then
      while read -r size us; do t[mpi.$size]=$us; done < <(mpirun --allow-run-as-root --oversubscribe -np 2 $MPI "$op" "$SIZES" | rows)
    fi
    for size in ${SIZES//,/ }; do
      echo "$r $op $size ${t[auto.$size]:-?} ${t[cached.$size]:-?} ${t[streaming.$size]:-?} ${t[mpi.$size]:--}"
    done
    unset t
  done
done
