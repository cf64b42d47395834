#!/usr/bin/env bash
# The Python package: build it from python/ with maturin into a fresh virtual environment
# outside the repository, then run its tests (pytest, numpy only; the torch tests skip
# themselves when torch is absent). Needs a Rust toolchain, python3 with venv, a C compiler
# (the fake CUDA driver) and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

venv=${LOCKSTEP_PY_VENV:-/tmp/lockstep-py-venv}
python=${PYTHON:-python3}
start=$SECONDS

rm -rf "$venv"
"$python" -m venv "$venv"
# ipykernel and jupyter_client: notebook_launcher is tested in a real notebook kernel too.
"$venv/bin/python" -m pip install -q --disable-pip-version-check maturin numpy pytest ipykernel jupyter_client
# The venv's maturin builds the wheel (no isolated build environment to download again);
# `pip install ./python` on its own works too and fetches maturin itself.
PATH="$venv/bin:$PATH" "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation "$repo/python"
echo "python package built and installed in $((SECONDS - start)) s"

# From outside the source tree (and with the pytest script, which does not put the current
# directory on sys.path), so `import lockstep` is the installed package.
cd /tmp
LOCKSTEP_REQUIRE_CC=1 PYTHONDONTWRITEBYTECODE=1 "$venv/bin/pytest" -q -p no:cacheprovider -rs "$repo/python/tests"
echo "python package: built and tested in $((SECONDS - start)) s"
