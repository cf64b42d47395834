#!/usr/bin/env bash
# The Python package as a user gets it: maturin builds the wheel (manylinux-tagged, checked by
# maturin's auditwheel pass) in a build environment, then a fresh virtual environment with no Rust
# toolchain on PATH installs only that wheel and runs the package's tests against it (pytest, numpy;
# the torch tests skip themselves when torch is absent) and the `lockstep` console script. Both
# environments live outside the repository. Needs a Rust toolchain (for the build), python3 with
# venv, a C compiler (the fake CUDA driver) and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

build_venv=${LOCKSTEP_PY_VENV:-/tmp/lockstep-py-venv}
venv=${LOCKSTEP_PY_TEST_VENV:-/tmp/lockstep-py-test-venv}
python=${PYTHON:-python3}
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
start=$SECONDS

rm -rf "$build_venv"
"$python" -m venv "$build_venv"
"$build_venv/bin/python" -m pip install -q --disable-pip-version-check maturin
"$build_venv/bin/maturin" build --release -m python/Cargo.toml --out "$wheels"
wheel=$(ls "$wheels"/lockstep_comm-*.whl)
echo "python: built $(basename "$wheel") in $((SECONDS - start)) s"
case $(basename "$wheel") in
    *manylinux*) ;;
    *) echo "python: the wheel $(basename "$wheel") has no manylinux tag" >&2; exit 1 ;;
esac

# The user's side: no cargo, rustc or rustup on PATH.
clean_path=$(tr ':' '\n' <<<"$PATH" | while read -r d; do [ -x "$d/cargo" ] || [ -x "$d/rustc" ] || echo "$d"; done | paste -sd:)
rm -rf "$venv"
"$python" -m venv "$venv"
# ipykernel and jupyter_client: notebook_launcher is tested in a real notebook kernel too.
env PATH="$venv/bin:$clean_path" "$venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel" numpy pytest ipykernel jupyter_client
(
    export PATH="$venv/bin:$clean_path"
    cd /tmp
    ! command -v cargo >/dev/null && ! command -v rustc >/dev/null || { echo "python: a Rust toolchain is still on PATH" >&2; exit 1; }
    lockstep --version
    lockstep env >/dev/null
    lockstep launch --nproc-per-node 2 python3 -c 'import lockstep'
    # From outside the source tree (and with the pytest script, which does not put the current
    # directory on sys.path), so `import lockstep` is the installed wheel.
    LOCKSTEP_REQUIRE_CC=1 PYTHONDONTWRITEBYTECODE=1 pytest -q -p no:cacheprovider -rs "$repo/python/tests"
)
echo "python package: built, installed and tested in $((SECONDS - start)) s"
