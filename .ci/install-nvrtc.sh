#!/usr/bin/env bash
# Install NVIDIA's NVRTC wheels under .ci-deps/, where lockstep's library discovery finds them
# (.ci-deps/*/nvidia/{cuda_nvrtc,cu13}/lib). No GPU or CUDA toolkit needed: tests/nvrtc_kernels.rs
# then compiles every kernels/*.cu to PTX (sm_80, sm_90) and CUBIN through the kernel cache, with
# each NVRTC installed here.
#
#   .ci-deps/nvrtc       nvidia-cuda-nvrtc-cu12==12.9.86 (CUDA 12.9, ~90 MB download);
#                        LOCKSTEP_NVRTC_WHEEL=<requirement> installs another one here instead
#   .ci-deps/nvrtc-13.0  nvidia-cuda-nvrtc==13.0.88 (~58 MB, nvidia/cu13/lib): the version PyTorch's
#                        cu130 builds pin. Its libnvrtc.so.13 has no $ORIGIN run path, so it finds
#                        libnvrtc-builtins.so.13.0 only because lockstep preloads it (this wheel
#                        failed every compile with NVRTC_ERROR_BUILTIN_OPERATION_FAILURE before).
#
# Idempotent: a folder that already holds a libnvrtc is left alone. .ci-deps/ is gitignored.
set -euo pipefail
cd "$(dirname "$0")/.."

install() {
    local dest=$1 wheel=$2
    if ls "$dest"/nvidia/*/lib/libnvrtc.so.* >/dev/null 2>&1; then
        echo "install-nvrtc: already installed: $(ls "$dest"/nvidia/*/lib/libnvrtc.so.*)"
        return 0
    fi
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --no-deps --disable-pip-version-check --target "$dest" "$wheel"
    ls "$dest"/nvidia/*/lib/libnvrtc.so.*
}

install .ci-deps/nvrtc "${LOCKSTEP_NVRTC_WHEEL:-nvidia-cuda-nvrtc-cu12==12.9.86}"
install .ci-deps/nvrtc-13.0 nvidia-cuda-nvrtc==13.0.88
