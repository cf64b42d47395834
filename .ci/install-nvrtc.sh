#!/usr/bin/env bash
# Install NVIDIA's NVRTC wheel (CUDA 12.x, ~90 MB download) into .ci-deps/nvrtc, where lockstep's
# library discovery finds it (.ci-deps/*/nvidia/cuda_nvrtc/lib). No GPU or CUDA toolkit needed:
# tests/nvrtc_kernels.rs then compiles every kernels/*.cu to PTX (sm_80, sm_90) and CUBIN.
# Idempotent: does nothing when the library is already there. .ci-deps/ is gitignored.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.ci-deps/nvrtc
version="${LOCKSTEP_NVRTC_WHEEL_VERSION:-12.9.86}"
if ls "$dest"/nvidia/cuda_nvrtc/lib/libnvrtc.so.* >/dev/null 2>&1; then
    echo "install-nvrtc: already installed in $dest"
    exit 0
fi
PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --no-deps --disable-pip-version-check --target "$dest" "nvidia-cuda-nvrtc-cu12==${version}"
ls "$dest"/nvidia/cuda_nvrtc/lib/libnvrtc.so.*
