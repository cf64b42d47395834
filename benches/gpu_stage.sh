#!/usr/bin/env bash
# Build lockstep here and stage what benches/gpu_verify.sh needs on a GPU machine that has no
# Rust toolchain and no network, into one folder to carry over (default .device/stage, which
# .gitignore keeps out of git).
#
#   benches/gpu_stage.sh [--no-build] [--stage DIR] [--data DIR | --no-data]
#
# What it does:
#   1. cargo build --release --tests --bins   (skipped with --no-build)
#   2. copies, with debug info stripped (objcopy --strip-debug: symbols stay, so backtraces
#      still name functions; release builds carry debug = 1, which triples their size):
#        bin/lockstep, bin/train-cnn
#        tests/{gpu_cuda,gpu_kernels,gpu_nccl,gpu_train,nvrtc_kernels}  (newest of each in
#        target/release/deps; harness = false binaries, runnable as they are)
#   3. the FashionMNIST IDX files (.gz) into data/fashion-mnist, from --data (default
#      /usr/share/datasets/fashion-mnist), when they fit in the 64 MiB budget
#   4. MANIFEST: git revision, build date, every file with its size, and the total
# and fails when the folder exceeds 64 MiB (the device tool's carry limit).
#
# Kernel sources (kernels/*.cu, common.cuh) are embedded in the binaries by build.rs; the
# scripts (benches/gpu_verify.sh, benches/baselines/*) are tracked files and travel with the
# working tree. Carry list for the device tool: [".device/stage"] (or the --stage folder).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

stage=.device/stage
data=/usr/share/datasets/fashion-mnist
build=1
with_data=1
while [ $# -gt 0 ]; do
    case "$1" in
        --no-build) build=0 ;;
        --stage) stage=$2; shift ;;
        --data) data=$2; shift ;;
        --no-data) with_data=0 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "gpu_stage: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
limit=$((64 * 1024 * 1024))

if [ "$build" = 1 ]; then
    cargo build --release --tests --bins
fi
command -v objcopy >/dev/null || { echo "gpu_stage: objcopy not found (binutils): it strips the debug info" >&2; exit 1; }

# The newest executable of a test target in target/release/deps (cargo keeps older hashes).
newest_test() {
    local name=$1 f best="" t best_t=0
    for f in target/release/deps/"$name"-*; do
        [ -f "$f" ] && [ -x "$f" ] && [[ "$f" != *.d ]] || continue
        t=$(stat -c %Y "$f")
        if [ "$t" -gt "$best_t" ]; then best=$f; best_t=$t; fi
    done
    [ -n "$best" ] || { echo "gpu_stage: no test binary $name in target/release/deps: run cargo build --release --tests" >&2; return 1; }
    echo "$best"
}

rm -rf "$stage"
mkdir -p "$stage/bin" "$stage/tests"
for b in lockstep train-cnn; do
    [ -x "target/release/$b" ] || { echo "gpu_stage: target/release/$b missing: run cargo build --release --bins" >&2; exit 1; }
    objcopy --strip-debug "target/release/$b" "$stage/bin/$b"
done
for t in gpu_cuda gpu_kernels gpu_nccl gpu_train nvrtc_kernels; do
    src=$(newest_test "$t")
    objcopy --strip-debug "$src" "$stage/tests/$t"
done

size_of() { du -sb "$1" | cut -f1; }
if [ "$with_data" = 1 ]; then
    files=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
    have=1
    for f in "${files[@]}"; do [ -f "$data/$f" ] || have=0; done
    if [ "$have" = 1 ]; then
        need=0
        for f in "${files[@]}"; do need=$((need + $(stat -c %s "$data/$f"))); done
        if [ $(( $(size_of "$stage") + need )) -le "$limit" ]; then
            mkdir -p "$stage/data/fashion-mnist"
            for f in "${files[@]}"; do cp "$data/$f" "$stage/data/fashion-mnist/"; done
        else
            echo "gpu_stage: FashionMNIST ($need bytes) does not fit in the 64 MiB budget: not staged (the GPU machine needs it at --data)" >&2
        fi
    else
        echo "gpu_stage: no FashionMNIST .gz files in $data: not staged (pass --data DIR)" >&2
    fi
fi

total=$(size_of "$stage")
{
    echo "lockstep GPU stage"
    echo "revision: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built:    $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm)"
    echo "files (bytes, debug info stripped):"
    (cd "$stage" && find . -type f ! -name MANIFEST -printf '  %10s  %P\n' | sort -k2)
    echo "total: $total bytes ($((total / 1024 / 1024)) MiB) of the 64 MiB limit"
} > "$stage/MANIFEST"
cat "$stage/MANIFEST"
if [ "$total" -gt "$limit" ]; then
    echo "gpu_stage: $stage is $total bytes, over the 64 MiB carry limit" >&2
    exit 1
fi
echo "carry: [\"$stage\"]   then on the GPU machine: benches/gpu_verify.sh --stage $stage"
