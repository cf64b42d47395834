#!/usr/bin/env bash
# One target directory, four builds with different feature sets of the runtime crate: the Python
# wheel (runtime with `log`), the binaries (train-cnn and lockstep: `config` and `log`), the C
# library (lockstep-capi: `log`) and the tests (every default member, features unified). Each
# must succeed whatever ran before it, and none may leave another stale: after one round in each
# order, a third round compiles neither the runtime nor the training engine nor the Python
# extension again (the runtime is an rlib with a hashed file name per feature set, so its builds
# sit side by side). The C library is one file, liblockstep.so: cargo relinks it (a few seconds)
# when a workspace build (`cargo test`, features unified) follows `-p lockstep-capi` or the other
# way round, and that is all.
#
# Needs maturin on PATH or in $LOCKSTEP_PY_VENV (.ci/python.sh makes that venv).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${LOCKSTEP_PY_VENV:-/tmp/lockstep-py-venv}
maturin=$(command -v maturin || echo "$venv/bin/maturin")
[ -x "$maturin" ] || { echo "build-orders: no maturin (run .ci/python.sh first, or pip install maturin)" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

wheel() { "$maturin" build --release -m python/Cargo.toml --out "$out/wheels"; }
bins() { cargo build --release -p lockstep-train -p lockstep-cli --bins; }
clib() { cargo build --release -p lockstep-capi; }
tests() { cargo test --release --no-run; }

# run ROUND STEP: the step's output in $out/ROUND.STEP.log; prints the lockstep crates it compiled.
run() {
    local log=$out/$1.$2.log
    if ! "$2" >"$log" 2>&1; then
        echo "build-orders: round $1: '$2' failed:" >&2
        tail -30 "$log" >&2
        exit 1
    fi
    local compiled
    compiled=$(grep -oE 'Compiling lockstep[a-z-]* v' "$log" | sed 's/ v$//; s/Compiling //' | sort -u | tr '\n' ' ' || true)
    echo "round $1: $2: ${compiled:-nothing of lockstep compiled}"
    if grep -qE 'Compiling lockstep-(comm|train|python) v' "$log"; then echo "$1 $2: $compiled" >>"$out/compiled"; fi
}

for s in wheel bins clib tests; do run 1 "$s"; done
for s in tests clib bins wheel; do run 2 "$s"; done
: >"$out/compiled"
for s in wheel tests bins clib; do run 3 "$s"; done
if [ -s "$out/compiled" ]; then
    echo "build-orders: after both orders, these builds still recompiled the runtime or the extension (one build made another stale):" >&2
    cat "$out/compiled" >&2
    exit 1
fi
echo "build-orders: wheel, binaries, C library and tests share one target directory in any order"
