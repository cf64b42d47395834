#!/usr/bin/env bash
# Build lockstep here and stage what benches/gpu_verify.sh needs on a GPU machine that has no
# Rust toolchain and no network, into one folder to carry over (default .device/stage, which
# .gitignore keeps out of git). docs/gpu.md says how it is used.
#
#   benches/gpu_stage.sh [--no-build] [--stage DIR] [--data DIR | --no-data] [--no-wheel]
#                        [--nccl-tests DIR]
#
# What it does:
#   1. cargo build --release -p lockstep-comm --test gpu_nccl, -p lockstep-train --bins --test
#      gpu_cuda --test gpu_kernels --test gpu_train, -p lockstep-cli -p lockstep-capi (the lockstep
#      command, liblockstep.so), and the Python wheel (maturin build --release in python/: one abi3 wheel,
#      so the GPU machine's Python 3.12 loads it); --no-build takes what target/ and
#      python/target/wheels already hold
#   2. copies, with debug info stripped (objcopy --strip-debug: symbols stay, so backtraces still
#      name functions; release builds carry debug = 1, which triples their size), then gzipped
#      (gpu_verify.sh unpacks them on the GPU machine):
#        bin/lockstep, bin/train-cnn, lib/liblockstep.so
#        tests/{gpu_cuda,gpu_kernels,gpu_nccl,gpu_train}  (newest of each in target/release/deps;
#        harness = false binaries, runnable as they are)
#   3. compiles the C programs against crates/capi/include/lockstep.h and the staged library (rpath
#      $ORIGIN/../lib, so they run wherever the stage lands):
#        capi/capi_test  (crates/capi/tests/c/capi_test.c: host buffers)
#        capi/capi_cuda  (benches/gpu/capi_cuda.c: device buffers with a CUDA stream)
#   4. python/lockstep_comm-*.whl
#   5. the FashionMNIST IDX files (.gz) into data/fashion-mnist, from --data (default
#      /usr/share/datasets/fashion-mnist), when they fit
#   6. with --nccl-tests DIR (a clone of github.com/NVIDIA/nccl-tests, or a folder of its
#      sources; default $NCCL_TESTS_SRC): its sources as nccl-tests.tar.gz, which the nccl_tests
#      step builds on the GPU machine (without it, that step says NOT CHECKED)
#   7. MANIFEST: git revision, every file with its size, and the travel total
# and fails when the stage plus the working tree that travels with it exceed 60 MiB
# (benches/gpu/common.sh; the device tool's own limit is 64 MiB), or when something is missing.
#
# Kernel sources (crates/train/kernels/*.cu, common.cuh) are embedded in the binaries by its build.rs; the
# scripts (benches/gpu_verify.sh, benches/gpu/*, benches/baselines/*) are tracked files and
# travel with the working tree. Carry list for the device tool: [".device/stage"].
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=benches/gpu/common.sh disable=SC1091  # followed with shellcheck -x from the root
. benches/gpu/common.sh

stage=.device/stage
data=/usr/share/datasets/fashion-mnist
build=1
with_data=1
with_wheel=1
nccl_tests=${NCCL_TESTS_SRC:-}
while [ $# -gt 0 ]; do
    case "$1" in
        --no-build) build=0 ;;
        --stage) stage=$2; shift ;;
        --data) data=$2; shift ;;
        --no-data) with_data=0 ;;
        --no-wheel) with_wheel=0 ;;
        --nccl-tests) nccl_tests=$2; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_stage: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
test_targets=(gpu_cuda gpu_kernels gpu_nccl gpu_train)

# maturin: $MATURIN, the one on PATH, the venv of .ci/python.sh, else a venv of its own here
# (installed from PyPI once; .device/ is ignored by git).
find_maturin() {
    local m
    for m in "${MATURIN:-}" "$(command -v maturin || true)" /tmp/lockstep-py-venv/bin/maturin .device/maturin-venv/bin/maturin; do
        if [ -n "$m" ] && [ -x "$m" ]; then echo "$m"; return 0; fi
    done
    python3 -m venv .device/maturin-venv >&2
    .device/maturin-venv/bin/python -m pip install -q --disable-pip-version-check 'maturin>=1.9.4,<2' >&2
    echo .device/maturin-venv/bin/maturin
}

if [ "$build" = 1 ]; then
    cargo build --release -p lockstep-comm --test gpu_nccl
    cargo build --release -p lockstep-train --bins --test gpu_cuda --test gpu_kernels --test gpu_train
    cargo build --release -p lockstep-cli -p lockstep-capi
    if [ "$with_wheel" = 1 ]; then
        maturin=$(find_maturin)
        case "$maturin" in /*) ;; *) maturin=$root/$maturin ;; esac
        rm -rf python/target/wheels
        (cd python && "$maturin" build --release --strip --out target/wheels)
    fi
fi
command -v objcopy >/dev/null || { echo "gpu_stage: objcopy not found (binutils): it strips the debug info" >&2; exit 1; }
command -v cc >/dev/null || { echo "gpu_stage: no C compiler (cc): it builds the C ABI programs" >&2; exit 1; }

# The newest executable of a test target in target/release/deps (cargo keeps older hashes).
newest_test() {
    local name=$1 f best="" t best_t=0
    for f in target/release/deps/"$name"-*; do
        if [ ! -f "$f" ] || [ ! -x "$f" ] || [[ "$f" == *.d ]]; then continue; fi
        t=$(stat -c %Y "$f")
        if [ "$t" -gt "$best_t" ]; then best=$f; best_t=$t; fi
    done
    [ -n "$best" ] || { echo "gpu_stage: no test binary $name in target/release/deps: run cargo build --release --test $name" >&2; return 1; }
    echo "$best"
}

rm -rf "$stage"
mkdir -p "$stage/bin" "$stage/tests" "$stage/lib" "$stage/capi"
for b in lockstep train-cnn; do
    [ -x "target/release/$b" ] || { echo "gpu_stage: target/release/$b missing: run cargo build --release --bins" >&2; exit 1; }
    objcopy --strip-debug "target/release/$b" "$stage/bin/$b"
done
[ -f target/release/liblockstep.so ] || { echo "gpu_stage: target/release/liblockstep.so missing: run cargo build --release -p lockstep-capi" >&2; exit 1; }
objcopy --strip-debug target/release/liblockstep.so "$stage/lib/liblockstep.so"
# Programs linked against it load it by its soname (liblockstep.so.MAJOR): a copy, not a link,
# since the device tool's carry may leave links behind.
soname=$(readelf -d target/release/liblockstep.so | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')
[ -n "$soname" ] || { echo "gpu_stage: target/release/liblockstep.so has no soname: build it with cargo build --release -p lockstep-capi" >&2; exit 1; }
cp "$stage/lib/liblockstep.so" "$stage/lib/$soname"
for t in "${test_targets[@]}"; do
    src=$(newest_test "$t")
    objcopy --strip-debug "$src" "$stage/tests/$t"
done

# The C programs: -Werror as tests/capi.rs builds capi_test; $ORIGIN keeps the stage relocatable.
for prog in capi_test:crates/capi/tests/c/capi_test.c capi_cuda:benches/gpu/capi_cuda.c; do
    name=${prog%%:*}
    # shellcheck disable=SC2016  # $ORIGIN is for the dynamic loader, not the shell
    cc -std=c11 -O2 -Wall -Wextra -Werror -pedantic -I crates/capi/include "${prog#*:}" -o "$stage/capi/$name" \
        -L "$stage/lib" -llockstep -ldl -Wl,--disable-new-dtags,-rpath,'$ORIGIN/../lib'
done

# The executables and the library travel gzipped (about a third of their size, which leaves room
# for FashionMNIST); benches/gpu_verify.sh unpacks them where they lie before its first step.
# The C programs above link against the uncompressed library, so this comes after them.
for f in "$stage"/bin/* "$stage"/tests/* "$stage"/lib/*; do
    gzip -9n "$f"
done

if [ "$with_wheel" = 1 ]; then
    wheel=$(find python/target/wheels -maxdepth 1 -name 'lockstep_comm-*.whl' -printf '%T@ %p\n' 2>/dev/null | sort -n | tail -1 | cut -d' ' -f2-)
    [ -n "$wheel" ] || { echo "gpu_stage: no wheel in python/target/wheels: run without --no-build (or pass --no-wheel)" >&2; exit 1; }
    mkdir -p "$stage/python"
    cp "$wheel" "$stage/python/"
fi

if [ -n "$nccl_tests" ]; then
    if git -C "$nccl_tests" rev-parse --verify -q HEAD > /dev/null 2>&1; then
        git -C "$nccl_tests" archive --format=tar.gz -o "$(cd "$stage" && pwd)/nccl-tests.tar.gz" HEAD
    elif [ -f "$nccl_tests/src/all_reduce.cu" ]; then
        tar czf "$stage/nccl-tests.tar.gz" -C "$nccl_tests" .
    else
        echo "gpu_stage: $nccl_tests is neither a git clone nor a source folder of nccl-tests (no src/all_reduce.cu)" >&2; exit 1
    fi
fi

tree=$(gpu_tree_bytes)
if [ "$with_data" = 1 ]; then
    files=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
    have=1
    for f in "${files[@]}"; do [ -f "$data/$f" ] || have=0; done
    if [ "$have" = 1 ]; then
        need=0
        for f in "${files[@]}"; do need=$((need + $(stat -c %s "$data/$f"))); done
        if [ $(( $(gpu_dir_bytes "$stage") + tree + need )) -le "$GPU_TRAVEL_LIMIT" ]; then
            mkdir -p "$stage/data/fashion-mnist"
            for f in "${files[@]}"; do cp "$data/$f" "$stage/data/fashion-mnist/"; done
        else
            echo "gpu_stage: FashionMNIST ($need bytes) does not fit in the ${GPU_TRAVEL_LIMIT_MIB} MiB with the stage and the tree: not staged (the train and baseline steps will say NOT CHECKED)" >&2
        fi
    else
        echo "gpu_stage: no FashionMNIST .gz files in $data: not staged (apt-get install dataset-fashion-mnist, or pass --data DIR)" >&2
    fi
fi

total=$(gpu_dir_bytes "$stage")
sum=$((total + tree))
{
    echo "lockstep GPU stage"
    echo "revision: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built on: $(uname -srm), $(ldd --version 2>/dev/null | head -1)"
    echo "files (bytes, debug info stripped; .gz: gzipped, unpacked by gpu_verify.sh):"
    (cd "$stage" && find . -type f ! -name MANIFEST -printf '  %10s  %P\n' | sort -k2)
    echo "stage: $total bytes ($(gpu_mib "$total") MiB); working tree: $tree bytes ($(gpu_mib "$tree") MiB)"
    echo "travels: $sum bytes ($(gpu_mib "$sum") MiB) of the ${GPU_TRAVEL_LIMIT_MIB} MiB limit"
} > "$stage/MANIFEST"
cat "$stage/MANIFEST"
if [ "$sum" -gt "$GPU_TRAVEL_LIMIT" ]; then
    echo "gpu_stage: the stage ($(gpu_mib "$total") MiB) plus the working tree ($(gpu_mib "$tree") MiB) exceed ${GPU_TRAVEL_LIMIT_MIB} MiB" >&2
    exit 1
fi
echo "carry: [\"$stage\"]   command: see docs/gpu.md (bash benches/gpu_verify.sh --fresh --budget 480)"
