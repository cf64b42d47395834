#!/usr/bin/env bash
# nccl-tests' all_reduce_perf next to `lockstep bench --device cuda`, on a GPU machine: one NCCL
# library for both, the same sizes, iterations and statistic (the mean time per call over the timed
# iterations, averaged over the ranks: nccl-tests' default, `-a 1`), one rank per GPU (one GPU:
# world size 1, which times each side's per-call cost around the same NCCL call).
#
#   benches/gpu/nccl_tests.sh LOCKSTEP NCCL_TESTS_TAR_GZ WORK_DIR NVCC PYTHON GPUS
#
# nccl-tests (github.com/NVIDIA/nccl-tests) is built in WORK_DIR from the source archive that
# benches/gpu_stage.sh --nccl-tests DIR stages, with nvcc for the first GPU's architecture only
# (the whole default list takes minutes). NCCL: the header and library of torch's nvidia wheel
# when there is one (as the bench_raw step), else the system's nccl.h and libnccl.so.2; lockstep
# is pointed at the same file with LOCKSTEP_NCCL_LIBRARY. Prints both tables, then one line per
# size: `side SIZE B: nccl-tests T us, lockstep T us (mean, -a 1), lockstep / nccl-tests R`.
# benches/gpu_verify.sh runs it as the nccl_tests step.
set -euo pipefail
[ $# -eq 6 ] || { echo "usage: $0 LOCKSTEP NCCL_TESTS_TAR_GZ WORK_DIR NVCC PYTHON GPUS" >&2; exit 2; }
lockstep=$1 tarball=$2 work=$3 nvcc=$4 python=$5 gpus=$6
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

rm -rf "$work"
mkdir -p "$work/src" "$work/nccl-home/lib"
tar xzf "$tarball" -C "$work/src"

inc=$("$python" - <<'PY' || true
import glob, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for h in sorted(glob.glob(d + '/nvidia/**/include/nccl.h', recursive=True)):
        print(h.rsplit('/include/', 1)[0]); sys.exit()
PY
)
if [ -n "$inc" ]; then
    lib=$(find "$inc/lib" -maxdepth 1 -name 'libnccl.so*' | sort | head -1)
    ln -s "$inc/include" "$work/nccl-home/include"
elif [ -f /usr/include/nccl.h ]; then
    lib=$(find /usr/lib/x86_64-linux-gnu /usr/lib64 -maxdepth 1 -name 'libnccl.so.2*' 2>/dev/null | sort | head -1)
    mkdir -p "$work/nccl-home/include"
    ln -s /usr/include/nccl.h "$work/nccl-home/include/nccl.h"
else
    echo "nccl_tests: no nccl.h (neither a site-packages nvidia wheel nor /usr/include)"; exit 1
fi
if [ -z "${lib:-}" ] || [ ! -f "$lib" ]; then echo "nccl_tests: no libnccl.so next to the header"; exit 1; fi
ln -s "$lib" "$work/nccl-home/lib/libnccl.so"
echo "NCCL for both sides: $lib"

cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
[ -n "$cap" ] || { echo "nccl_tests: nvidia-smi gave no compute capability"; exit 1; }
cuda_home=$(dirname "$(dirname "$nvcc")")
echo "building all_reduce_perf for sm_$cap with $nvcc"
if ! make -C "$work/src/src" -j"$(nproc)" MPI=0 BUILDDIR="$work/build" NCCL_HOME="$work/nccl-home" \
    CUDA_HOME="$cuda_home" NVCC="$nvcc" NVCC_GENCODE="-gencode=arch=compute_$cap,code=sm_$cap" \
    "$work/build/all_reduce_perf" > "$work/build.log" 2>&1; then
    tail -40 "$work/build.log"
    echo "nccl_tests: the nccl-tests build failed"
    exit 1
fi

export LD_LIBRARY_PATH="$work/nccl-home/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
args=(-b 8 -e 16M -f 8 -n 200 -w 20 -c 1 -a 1)
echo "--- nccl-tests all_reduce_perf -g $gpus ${args[*]} ---"
"$work/build/all_reduce_perf" -g "$gpus" "${args[@]}" | tee "$work/nccl_tests.txt"
echo "--- lockstep bench --device cuda --nprocs $gpus ${args[*]} --stat mean ---"
(cd "$root" && LOCKSTEP_NCCL_LIBRARY="$lib" "$lockstep" bench --device cuda --nprocs "$gpus" "${args[@]}" --stat mean) \
    | tee "$work/lockstep.txt"
# Both sides must run NCCL: a lockstep rank that staged through host memory would compare another
# backend with nccl-tests.
if ! grep -q '^#  Rank .*backend nccl' "$work/lockstep.txt" || grep -q '^#  Rank .*backend staged' "$work/lockstep.txt"; then
    echo "nccl_tests: lockstep bench did not run every rank on NCCL (see its '#  Rank' lines): the side-by-side would compare another backend"
    exit 1
fi
echo "--- side by side: out-of-place time, mean over 200 iterations, averaged over ranks (-a 1) ---"
awk 'NR == FNR { if ($1 ~ /^[0-9]+$/) t[$1] = $6; next }
     $1 ~ /^[0-9]+$/ && ($1 in t) && t[$1] > 0 {
         printf "side %s B: nccl-tests %.2f us, lockstep %.2f us (mean, -a 1), lockstep / nccl-tests %.2f\n", $1, t[$1], $6, $6 / t[$1]; n++ }
     END { if (n == 0) { print "nccl_tests: no size appears in both tables"; exit 1 } }' \
    "$work/nccl_tests.txt" "$work/lockstep.txt"
