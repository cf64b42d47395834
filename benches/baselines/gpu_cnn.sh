#!/usr/bin/env bash
# Run the GPU CNN comparison (PyTorch eager, torch.compile reduce-overhead, train-cnn --device
# cuda) in one invocation on a GPU machine.
#
#   benches/baselines/gpu_cnn.sh [path/to/train-cnn] [extra gpu_cnn.py args...]
#
# The binary defaults to target/release/train-cnn (build it with `cargo build --release --bin
# train-cnn`, or carry it from another machine: it needs only libcuda + libnvrtc at run time).
# The dataset defaults to /usr/share/datasets/fashion-mnist; pass --data DIR otherwise.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${1:-$root/target/release/train-cnn}"
[ $# -gt 0 ] && shift
if [ ! -x "$bin" ]; then
    echo "train-cnn binary not found at $bin: build it (cargo build --release --bin train-cnn) or pass its path" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
exec python3 "$here/gpu_cnn.py" --train-cnn "$bin" "$@"
