# Sourced by benches/gpu_stage.sh and benches/gpu_verify.sh: the device tool's limits and the
# size arithmetic behind them, in one place so the stage and the dry run measure alike.
#
# What travels to the GPU machine is the working tree (tracked files, and untracked files git
# does not ignore) plus the carried paths; the tool refuses more than 64 MiB in all. 60 MiB is the
# ceiling here, so the tree may grow a little between staging and the call.

# shellcheck shell=bash
# shellcheck disable=SC2034  # the limits are read by the scripts that source this file

GPU_TRAVEL_LIMIT=$((60 * 1024 * 1024))
GPU_TRAVEL_LIMIT_MIB=60

# Bytes of the working tree that travels with a device call (run from the repository root).
# Symbolic links travel as links, so their own size counts (stat without -L).
gpu_tree_bytes() {
    git ls-files -z --cached --others --exclude-standard \
        | { xargs -0 -r stat -c %s -- 2>/dev/null || true; } \
        | awk '{ s += $1 } END { printf "%d\n", s }'
}

# Bytes of the regular files under a folder.
gpu_dir_bytes() {
    find "$1" -type f -printf '%s\n' | awk '{ s += $1 } END { printf "%d\n", s }'
}

# A byte count in MiB with one decimal.
gpu_mib() {
    awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'
}
