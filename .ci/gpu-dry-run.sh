#!/usr/bin/env bash
# The GPU verification still fits a lent machine's 15-minute window (docs/gpu.md), checked without
# a GPU: stage the binaries, the C programs and the Python wheel (within 60 MiB with the tree),
# walk the plan in a dry run (rehearsing what the simulated driver can run), and test the
# statuses CUT and NOT CHECKED on a fake stage. Needs what .ci/run installs first (cc, the
# FashionMNIST package) and a Python with venv for maturin (.ci/python.sh's venv is reused).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash benches/gpu_stage.sh
bash benches/gpu_verify.sh --dry-run
bash benches/gpu/test_gpu_verify.sh
echo "gpu dry run: staged, walked and tested in $((SECONDS - start)) s"
