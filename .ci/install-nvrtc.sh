#!/usr/bin/env bash
# Install NVIDIA's NVRTC wheel into .ci-deps/nvrtc, where lockstep's library discovery finds it
# (.ci-deps/*/nvidia/{cuda_nvrtc,cu13}/lib). No GPU or CUDA toolkit needed: tests/nvrtc_kernels.rs
# then compiles every kernels/*.cu to PTX (sm_80, sm_90) and CUBIN through the kernel cache.
#
# Default: CUDA 12.9 (nvidia-cuda-nvrtc-cu12, ~90 MB download). For CUDA 13 use
#   LOCKSTEP_NVRTC_WHEEL=nvidia-cuda-nvrtc==13.5.37 .ci/install-nvrtc.sh   (~58 MB, nvidia/cu13/lib)
# Idempotent: does nothing when a libnvrtc is already there. .ci-deps/ is gitignored.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.ci-deps/nvrtc
wheel="${LOCKSTEP_NVRTC_WHEEL:-nvidia-cuda-nvrtc-cu12==12.9.86}"
if ls "$dest"/nvidia/*/lib/libnvrtc.so.* >/dev/null 2>&1; then
    echo "install-nvrtc: already installed: $(ls "$dest"/nvidia/*/lib/libnvrtc.so.*)"
    exit 0
fi
PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --no-deps --disable-pip-version-check --target "$dest" "$wheel"
ls "$dest"/nvidia/*/lib/libnvrtc.so.*
