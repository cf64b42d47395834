#!/usr/bin/env bash
# Verify lockstep on a GPU machine lent for minutes, from binaries built elsewhere
# (benches/gpu_stage.sh) and carried over: the machine needs a CUDA driver, and for some steps
# PyTorch (its NCCL wheel, torch.compile), nvcc and compute-sanitizer; no Rust, no network.
# docs/gpu.md is the guide: the exact device commands, what travels, what comes back.
#
#   benches/gpu_verify.sh [--fresh] [--budget S] [--second] [--only STEP[,STEP...]]
#                         [--dry-run] [--list] [--stage DIR] [--data DIR] [--state DIR]
#                         [--estimates STEP=EST[:LIMIT][,...]]
#
# Plans, in priority order (estimates, in seconds, sum to at most the budget less a reserve):
#   main (default, --budget 480): env gpu_cuda kernels gpu_train train_fp32 train_bf16 nccl
#       memcheck kernels_tf32 two_ranks_staged two_ranks_nccl capi python racecheck baselines
#       compile_baselines
#   second (--second, --budget 180; on the still-warm machine): racecheck_full bench_raw recovery
# `--list` prints every step with its estimate, its own time limit and what it checks.
#
# Each step ends as one of:
#   PASS          it ran and every check in it passed;
#   FAIL          it ran and failed, or ran past its own time limit (a hang): the exit code is 1;
#   CUT           the budget stopped it, or it was not started because its estimate exceeded the
#                 time left: not a failure (the exit code ignores it), nothing is claimed;
#   NOT CHECKED   it cannot check anything on this machine, with the reason (no second GPU and
#                 NCCL < 2.30 for two NCCL ranks, no compute-sanitizer or gVisor, no torch, a dry
#                 run): never PASS.
# A gpu_* test binary that prints `test NAME ... skipped: WHY` adds a NOT CHECKED row STEP/NAME.
#
# --budget S: the invocation's steps end within S seconds: a step starts only when its estimate
# fits in the time left, and its time limit is clipped to the time left (killed there: CUT).
# 0 means no budget. --only picks steps from either plan, in the order given; a test step takes a
# filter (--only memcheck:conv2d runs the checks whose name contains "conv2d").
#
# The report is rewritten after every step (a run cut short still leaves what it did), in the
# state folder (.device/, accumulating over invocations until --fresh) and mirrored into $OUT
# when set (the device tool's output folder): gpu_verify_report.md (machine facts, the table,
# each step's command and output), gpu_verify_summary.tsv, gpu_verify_facts.txt and
# gpu_verify_logs.tar.gz (every step's whole output).
#
# --dry-run (no GPU; CI runs it): walks both plans, reporting NOT CHECKED for every step that
# needs a real GPU; rehearses the env, nccl and capi steps with the staged binaries on the
# simulated CUDA driver and NCCL (tests/fake, built here with cc; one GPU, NCCL 2.28.9 unless
# GPU_VERIFY_SIM_NCCL says otherwise); checks the stage, the stage plus the working tree against
# 60 MiB, the device commands against docs/gpu.md and the tool's 2,000 characters, the result
# files against the tool's limits, and the budget arithmetic; and ends with the line
# `planned: N s for M steps` of the main run.
#
# Every test runs with LOCKSTEP_REQUIRE_GPU=1 (a missing GPU or NCCL is a failure, not a skip) and
# LOCKSTEP_TIMEOUT_S=60 (an NCCL or collective hang becomes an error within a minute).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=benches/gpu/common.sh disable=SC1091  # followed with shellcheck -x from the root
. benches/gpu/common.sh

# The device commands docs/gpu.md gives (the dry run checks both against it), the path they
# carry, and the device tool's limits they must meet.
MAIN_BUDGET=480
SECOND_BUDGET=180
MAIN_COMMAND="bash benches/gpu_verify.sh --fresh --budget $MAIN_BUDGET"
SECOND_COMMAND="bash benches/gpu_verify.sh --second --budget $SECOND_BUDGET"
CARRY=.device/stage
TOOL_COMMAND_CHARS=2000
TOOL_TIMEOUT_S=600
TOOL_DEVICE_S=900
TOOL_WARM_S=30
TOOL_OUT_FILES=8
TOOL_OUT_FILE_BYTES=$((16 * 1024 * 1024))
# Device time the plan assumes around the two commands: the machine's start and its release.
ASSUMED_START_S=120
ASSUMED_RELEASE_S=30
# Kept back from every budget: the report written after the last step, and a clipped step's
# kill-after grace.
RESERVE_S=10
OUT_FILES=(gpu_verify_report.md gpu_verify_summary.tsv gpu_verify_facts.txt gpu_verify_logs.tar.gz)

declare -A EST LIMIT WHAT
# step ESTIMATE LIMIT WHAT: the estimate plans the budget (a guess until a report gives real
# seconds); the limit is the step's own bound, past which it is a hang (FAIL).
step() { EST[$1]=$2; LIMIT[$1]=$3; WHAT[$1]=$4; }
step env 10 60 "machine facts: GPU, driver, compute mode, runtime, CUDA/torch/NCCL, lockstep env"
step gpu_cuda 10 120 "tests/gpu_cuda: contexts, memory, streams, graphs, the init guard, 3 staged ranks"
step kernels 20 240 "tests/gpu_kernels, TF32 off: every kernel against its CPU twin"
step gpu_train 10 300 "tests/gpu_train: GPU vs CPU engine, bit-identical runs, train-cnn 1 and 2 ranks"
step train_fp32 30 240 "train-cnn --device cuda, fp32, 4 epochs of FashionMNIST"
step train_bf16 20 240 "train-cnn --device cuda, bf16, 4 epochs"
step nccl 10 150 "tests/gpu_nccl: every collective at world size 1, aborts, two NCCL ranks"
step memcheck 10 400 "compute-sanitizer memcheck on tests/gpu_kernels"
step kernels_tf32 10 240 "tests/gpu_kernels, TF32 on (the default options: train-cnn's compile cache)"
step two_ranks_staged 10 180 "train-cnn, 2 ranks on one GPU staged through shared memory, 1 epoch"
step two_ranks_nccl 25 180 "train-cnn, 2 NCCL ranks (2 GPUs, or one in NCCL >= 2.30 multi-rank mode)"
step capi 10 90 "the C ABI: capi_test on host buffers, capi_cuda on device buffers with a CUDA stream"
step python 25 180 "the Python wheel: lockstep.torch on CUDA tensors, 2 ranks then 1, collectives and DDP"
step racecheck 10 240 "compute-sanitizer racecheck on tests/gpu_kernels' GEMM checks (filter: linear)"
step baselines 60 240 "PyTorch eager, fp32 and bf16, 2 epochs (benches/baselines/gpu_cnn.sh)"
step compile_baselines 90 420 "PyTorch torch.compile(reduce-overhead), fp32, 2 epochs (bf16 compiles for longer: --only)"
step racecheck_full 60 540 "compute-sanitizer racecheck on every tests/gpu_kernels check"
step bench_raw 60 240 "lockstep bench --device cuda, 2 ranks, next to raw ncclAllReduce (nvcc)"
step recovery 45 180 "train-cnn's in-job recovery on the GPU: rank 1 killed in epoch 2 of 4, against an undisturbed run"
step nccl_tests 100 300 "nccl-tests all_reduce_perf (built there with nvcc) next to lockstep bench --device cuda: one NCCL, same sizes and statistic"
MAIN_STEPS=(env gpu_cuda kernels gpu_train train_fp32 train_bf16 nccl memcheck kernels_tf32 two_ranks_staged two_ranks_nccl capi python racecheck nccl_tests baselines compile_baselines)
SECOND_STEPS=(racecheck_full bench_raw recovery)
# Steps the dry run rehearses on the simulated driver (they need no kernels).
REHEARSED=" env nccl capi "

stage=.device/stage
data=""
state=.device
only=""
budget=""
second=0
fresh=0
dry=0
overrides=""
list=0
while [ $# -gt 0 ]; do
    case "$1" in
        --stage) stage=$2; shift ;;
        --data) data=$2; shift ;;
        --state) state=$2; shift ;;
        --only) only=$2; shift ;;
        --budget) budget=$2; shift ;;
        --second) second=1 ;;
        --fresh) fresh=1 ;;
        --dry-run) dry=1 ;;
        --estimates) overrides=$2; shift ;;
        --list) list=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_verify: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
known() { [ -n "${EST[$1]+x}" ]; }
for o in ${overrides//,/ }; do
    s=${o%%=*} v=${o#*=}
    known "$s" || { echo "gpu_verify: --estimates: unknown step $s (see --list)" >&2; exit 2; }
    [[ "$v" =~ ^[0-9]+(:[0-9]+)?$ ]] || { echo "gpu_verify: --estimates: $o is not STEP=EST[:LIMIT]" >&2; exit 2; }
    EST[$s]=${v%%:*}
    [[ "$v" == *:* ]] && LIMIT[$s]=${v#*:}
done
if [ "$list" = 1 ]; then
    for plan in main second; do
        echo "$plan run:"
        if [ "$plan" = main ]; then names=("${MAIN_STEPS[@]}"); else names=("${SECOND_STEPS[@]}"); fi
        for s in "${names[@]}"; do printf '  %-18s ~%4s s (limit %4s s)  %s\n' "$s" "${EST[$s]}" "${LIMIT[$s]}" "${WHAT[$s]}"; done
    done
    exit 0
fi
if [ -z "$budget" ]; then budget=$MAIN_BUDGET; [ "$second" = 1 ] && budget=$SECOND_BUDGET; fi
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu_verify: --budget takes whole seconds (0: none)" >&2; exit 2; }

# The steps of this invocation: --only's, else the plan's (a dry run walks both plans).
walk=()
if [ -n "$only" ]; then
    for s in ${only//,/ }; do
        known "${s%%:*}" || { echo "gpu_verify: unknown step ${s%%:*} (see --list)" >&2; exit 2; }
        walk+=("$s")
    done
elif [ "$dry" = 1 ]; then
    walk=("${MAIN_STEPS[@]}" "${SECOND_STEPS[@]}")
elif [ "$second" = 1 ]; then
    walk=("${SECOND_STEPS[@]}")
else
    walk=("${MAIN_STEPS[@]}")
fi

# A dry run keeps its own report, always fresh, so it never mixes with a real run's.
if [ "$dry" = 1 ]; then state=$state/dry-run; fresh=1; fi
mkdir -p "$state"
state=$(cd "$state" && pwd)
work=$state/gpu_verify_work
summary=$state/gpu_verify_summary.tsv
sections=$state/gpu_verify_sections.md
report=$state/gpu_verify_report.md
facts=$work/facts.txt
if [ "$fresh" = 1 ]; then rm -rf "$work" "$summary" "$sections" "$report"; fi
mkdir -p "$work/logs"
touch "$summary" "$sections"
out=${OUT:-}
if [ "$dry" = 1 ] && [ -z "$out" ]; then out=$work/out; rm -rf "$out"; fi
[ -n "$out" ] && mkdir -p "$out"
start=$SECONDS
failed=0

stage_abs=$(cd "$stage" 2>/dev/null && pwd) || stage_abs=""
# benches/gpu_stage.sh gzips the executables and the library so FashionMNIST fits in the carry:
# unpack them in place (a second run finds them unpacked already). The travel check measures the
# stage as it travelled, so its size is taken first.
stage_travel_bytes=0
if [ -n "$stage_abs" ]; then
    stage_travel_bytes=$(gpu_dir_bytes "$stage_abs")
    # A dry run rehearses on a copy (hard links where it can: unpacking replaces files, never
    # writes into them), so the stage stays packed and can still travel.
    if [ "$dry" = 1 ]; then
        rm -rf "$work/stage"
        cp -al "$stage_abs" "$work/stage" 2>/dev/null || { rm -rf "$work/stage"; cp -a "$stage_abs" "$work/stage"; }
        stage_abs=$work/stage
    fi
    for f in "$stage_abs"/bin/*.gz "$stage_abs"/tests/*.gz "$stage_abs"/lib/*.gz; do
        [ -f "$f" ] || continue
        gzip -dc "$f" > "${f%.gz}.tmp" && chmod 755 "${f%.gz}.tmp" && mv -f "${f%.gz}.tmp" "${f%.gz}" && rm -f "$f" \
            || echo "gpu_verify: could not unpack $f (the stage step will name what is missing)" >&2
    done
fi
BIN=$stage_abs/bin
TESTS=$stage_abs/tests
if [ -z "$data" ]; then
    for d in "$stage_abs/data/fashion-mnist" /usr/share/datasets/fashion-mnist; do
        if [ -f "$d/train-images-idx3-ubyte.gz" ] || [ -f "$d/train-images-idx3-ubyte" ]; then data=$d; break; fi
    done
fi
wheel=""
for w in "$stage_abs"/python/lockstep_comm-*.whl; do if [ -f "$w" ]; then wheel=$w; fi; done

export LOCKSTEP_REQUIRE_GPU=1 LOCKSTEP_TIMEOUT_S=60 LOCKSTEP_TRAIN_CNN=$BIN/train-cnn PYTHONUNBUFFERED=1
# A private kernel cache shared by every step: kernels_tf32 reuses the images train-cnn compiled
# with the same (default) options, memcheck and racecheck the ones of the kernels step.
export XDG_CACHE_HOME=$work/cache

# The dry run's simulated GPU: the driver of tests/fake/sim_cuda.c without the SIMT shim (memory,
# streams and copies, no kernels) and the simulated NCCL, both built here with cc.
sim=0
sim_why=""
if [ "$dry" = 1 ]; then
    if ! command -v cc >/dev/null; then
        sim_why="no C compiler (cc) to build the simulated driver"
    elif [ ! -x "$BIN/lockstep" ]; then
        sim_why="no staged binaries"
    else
        mkdir -p "$work/sim"
        if cc -shared -fPIC -O1 -o "$work/sim/libcuda.so.1" tests/fake/sim_cuda.c -Wl,-soname,libcuda.so.1 2> "$work/sim/build.log" \
            && cc -shared -fPIC -O1 -o "$work/sim/libnccl.so.2" tests/fake/sim_nccl.c -Wl,-soname,libnccl.so.2 2>> "$work/sim/build.log"; then
            sim=1
            export LOCKSTEP_CUDA_LIBRARY=$work/sim/libcuda.so.1 LOCKSTEP_NCCL_LIBRARY=$work/sim/libnccl.so.2
            export SIM_CUDA_DEVICES=1 SIM_NCCL_VERSION=${GPU_VERIFY_SIM_NCCL:-22809}
        else
            sim_why="the simulated driver did not build: $(head -3 "$work/sim/build.log" | tr '\n' ' ')"
        fi
    fi
fi

first_path() {
    local c
    for c in "$@"; do
        if [ -x "$c" ]; then echo "$c"; return 0; fi
        c=$(command -v "$c" 2>/dev/null || true)
        if [ -n "$c" ]; then echo "$c"; return 0; fi
    done
    return 0
}

# ---------------------------------------------------------------------------------------------
# Machine facts, before any step: what the steps' decisions rest on.
GPUS=0 NCCL_CODE=0 NCCL_STR="" RUNTIME="" SANITIZER="" NVCC="" PYTHON="" TORCH=0
probe_facts() {
    local smi="" env_txt=$work/lockstep_env.txt kernel
    if [ "$sim" = 1 ]; then
        GPUS=$SIM_CUDA_DEVICES
    else
        GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
        smi=$(nvidia-smi --query-gpu=index,name,driver_version,compute_mode,memory.total --format=csv,noheader 2>/dev/null || true)
    fi
    GPUS=${GPUS:-0}
    kernel=$(uname -r)
    # gVisor reports a fixed 4.4.0 kernel; the lent Firecracker machines' kernels carry "-fc-".
    case "$kernel" in
        4.4.0) RUNTIME="gVisor (kernel 4.4.0)" ;;
        *-fc-*) RUNTIME="Firecracker (kernel $kernel)" ;;
        *) RUNTIME="not gVisor (kernel $kernel)" ;;
    esac
    if [ -x "$BIN/lockstep" ]; then "$BIN/lockstep" env > "$env_txt" 2>&1 || true; else echo "(no staged lockstep)" > "$env_txt"; fi
    NCCL_CODE=$(sed -n 's/.*ncclGetVersion = \([0-9][0-9]*\).*/\1/p' "$env_txt" | head -1)
    NCCL_CODE=${NCCL_CODE:-0}
    NCCL_STR=$(sed -n 's/.*ncclGetVersion = [0-9]* (\([^)]*\)).*/\1/p' "$env_txt" | head -1)
    SANITIZER=$(first_path compute-sanitizer /usr/local/cuda/bin/compute-sanitizer)
    NVCC=$(first_path nvcc /usr/local/cuda/bin/nvcc)
    PYTHON=$(first_path python3)
    TORCH=0
    if [ -n "$PYTHON" ] && "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("torch") else 1)' 2>/dev/null; then TORCH=1; fi
    {
        echo "gpus: $GPUS${smi:+ ($(echo "$smi" | tr '\n' ';' | sed 's/;$//'))}$([ "$sim" = 1 ] && echo ' (simulated: dry run)')"
        echo "runtime: $RUNTIME$(case "$RUNTIME" in gVisor*) echo ': compute-sanitizer refuses it' ;; esac)"
        echo "nccl: ${NCCL_STR:-none found} (ncclGetVersion $NCCL_CODE); several ranks per GPU (NCCL_MULTI_RANK_GPU_ENABLE): $(if [ "$NCCL_CODE" -ge 23000 ]; then echo yes; else echo 'no (needs NCCL 2.30)'; fi)"
        echo "two NCCL ranks: $(if why=$(two_rank_nccl_why); then echo "possible"; else echo "not possible: $why"; fi)"
        echo "compute-sanitizer: ${SANITIZER:-none}; nvcc: ${NVCC:-none}; python3: ${PYTHON:-none} (torch: $([ "$TORCH" = 1 ] && echo yes || echo no))"
        echo "stage: ${stage_abs:-missing} ($(sed -n 's/^revision: //p' "$stage_abs/MANIFEST" 2>/dev/null || echo 'no MANIFEST'))"
        echo "data: ${data:-none}"
        echo "libraries chosen by lockstep (lockstep env):"
        grep -E '^  (driver|nvrtc|nccl) |chosen:|Version =' "$env_txt" | sed 's/^/  /' || echo "  (lockstep env printed none)"
    } > "$facts"
}

# Why two ranks cannot run on NCCL here (status 1), or nothing (status 0).
two_rank_nccl_why() {
    if [ "$NCCL_CODE" -le 0 ]; then echo "lockstep finds no NCCL library"; return 1; fi
    if [ "$GPUS" -ge 2 ] || { [ "$GPUS" -eq 1 ] && [ "$NCCL_CODE" -ge 23000 ]; }; then return 0; fi
    if [ "$GPUS" -eq 1 ]; then
        echo "one GPU and NCCL ${NCCL_STR:-$NCCL_CODE} (older than 2.30, no multi-rank mode): two ranks of one NCCL communicator need two GPUs or NCCL_MULTI_RANK_GPU_ENABLE=1 with NCCL 2.30 or newer"
    else
        echo "no GPU found"
    fi
    return 1
}

# ---------------------------------------------------------------------------------------------
# The report.
write_report() {
    {
        echo "# lockstep GPU verification"
        echo
        echo "Report rewritten after every step; updated $(date -u +%Y-%m-%dT%H:%M:%SZ)$([ "$dry" = 1 ] && echo ', DRY RUN (no GPU: nothing here was checked on one)')."
        echo
        echo "## Machine"
        echo
        echo '```'
        cat "$facts" 2>/dev/null || true
        echo '```'
        echo
        echo "## Steps (newest last)"
        echo
        echo "| step | result | seconds | estimate | detail |"
        echo "|---|---|---|---|---|"
        awk -F'\t' '{ printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5 }' "$summary"
        echo
        echo "## Output of each step"
        echo
        cat "$sections"
    } > "$report"
    [ -n "$out" ] || return 0
    cp "$report" "$out/gpu_verify_report.md"
    cp "$summary" "$out/gpu_verify_summary.tsv"
    cp "$facts" "$out/gpu_verify_facts.txt" 2>/dev/null || true
    tar -czf "$out/gpu_verify_logs.tar.gz" -C "$work" logs lockstep_env.txt facts.txt 2>/dev/null || true
    if [ "$(stat -c %s "$out/gpu_verify_logs.tar.gz" 2>/dev/null || echo 0)" -gt "$TOOL_OUT_FILE_BYTES" ]; then
        rm -f "$out/gpu_verify_logs.tar.gz"
        echo "(logs over the tool's 16 MiB per file: see $work/logs on the machine)" > "$out/gpu_verify_logs.txt"
    fi
}

# record NAME STATUS SECONDS DETAIL [LOG COMMAND]
record() {
    local name=$1 status=$2 secs=$3 detail=$4 log=${5:-} cmd=${6:-} est=${EST[${1%%:*}]:-}
    detail=$(printf '%s' "$detail" | tr '\t|\n' '  ;' | cut -c1-400)
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "$est" "$detail" >> "$summary"
    [ "$status" = FAIL ] && failed=1
    if [ -n "$cmd" ]; then
        {
            echo "### $name: $status ($secs s)"
            echo
            echo '```'
            echo "\$ $cmd"
            if [ -n "$log" ] && [ -f "$log" ]; then
                if [ "$(wc -l < "$log")" -le 200 ]; then cat "$log"; else head -60 "$log"; echo "... ($(wc -l < "$log") lines; the whole output is in gpu_verify_logs.tar.gz) ..."; tail -140 "$log"; fi
            fi
            echo '```'
            echo
        } >> "$sections"
    fi
    write_report
    echo "gpu_verify: $name: $status ($secs s)${detail:+ -- $detail}"
}

# One summary line from a step's output: test counts, accuracies, speeds.
figures() {
    local s=$1 log=$2
    case "$s" in
        train_*|two_ranks_*)
            "${PYTHON:-python3}" - "$log" <<'EOF' 2>/dev/null || true
import json, sys
rows = []
for line in open(sys.argv[1], errors="replace"):
    line = line.strip()
    if line.startswith("{") and '"test_acc"' in line:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
if rows:
    last = rows[-1]
    speeds = [r["images_per_s"] for r in rows[1:]] or [rows[0]["images_per_s"]]
    print(f'{len(rows)} epochs; test acc {last["test_acc"]:.2f} %; {sum(speeds)/len(speeds):.0f} img/s (mean after epoch 1); last epoch {last["epoch_s"]:.2f} s')
EOF
            ;;
        env) head -3 "$facts" | tr '\n' ';' ;;
        memcheck|racecheck|racecheck_full) grep -E 'ERROR SUMMARY|^test result|^[0-9]+ passed, [0-9]+ skipped, [0-9]+ failed' "$log" | tail -2 | tr '\n' ';' ;;
        baselines|compile_baselines) grep -E 'eager|compile' "$log" | tail -4 | tr -s ' ' | tr '\n' ';' ;;
        bench_raw) grep -E '^overhead' "$log" | tr '\n' ';' ;;
        recovery) grep -E '^recovery: (undisturbed|killed|all bars|FAIL)' "$log" | tr '\n' ';' ;;
        nccl_tests) grep -E '^side ' "$log" | sed 's/ (mean, -a 1)//' | tr '\n' ';' ;;
        python) grep -E 'rank 0: |rank 0 DDP:|all checks passed' "$log" | tail -5 | tr '\n' ';' ;;
        capi) echo "capi_test: $(grep -c 'all checks passed' "$log") ranks passed; capi_cuda: $(grep -c 'CUDA stream checks passed' "$log") ranks passed" ;;
        *) grep -E '^test result|^[0-9]+ passed, [0-9]+ skipped, [0-9]+ failed' "$log" | tail -1 ;;
    esac
}

# A step-specific check of a passed step's output: prints why it failed after all, if it did.
post_check() {
    local s=$1 log=$2 r want=""
    case "$s" in
        train_fp32|train_bf16) grep -q '"test_acc"' "$log" || echo "no epoch line (--json) in the output" ;;
        two_ranks_staged) want="choice=Staged" ;;
        two_ranks_nccl) want="choice=Nccl" ;;
        capi) [ "$(grep -c 'CUDA stream checks passed' "$log")" -ge 2 ] || echo "fewer than 2 ranks passed the CUDA stream checks" ;;
        python) grep -q 'all checks passed' "$log" || echo "no 'all checks passed' line" ;;
        recovery) grep -q '^recovery: all bars met' "$log" || echo "no 'recovery: all bars met' line" ;;
    esac
    if [ -n "$want" ]; then
        for r in 0 1; do
            grep -q "device backend selected rank=$r .*$want" "$log" || { echo "rank $r did not log '$want' (it ran on another backend: see the output)"; return 0; }
        done
    fi
    return 0
}

# ---------------------------------------------------------------------------------------------
# What a step runs (CMD), or why it cannot run here (WHY; empty when it can).
plan_step() {
    local s=$1 f=$2 require="" multi="" t sizes
    CMD="" WHY=""
    case "$s" in
        env)
            # shellcheck disable=SC2016  # single quotes quote paths for the step's own shell
            CMD="rc=0
echo '== nvidia-smi'; nvidia-smi 2>&1 || echo '(nvidia-smi failed or is missing)'
echo '== GPUs'; nvidia-smi --query-gpu=index,name,driver_version,compute_mode,memory.total,pci.bus_id --format=csv 2>&1 || true
echo '== kernel'; uname -a; grep -m1 -i gvisor /proc/version 2>/dev/null || true
echo '== lockstep env'; '$BIN/lockstep' env || rc=\$?
echo '== tools'; echo 'compute-sanitizer: ${SANITIZER:-none}'; echo 'nvcc: ${NVCC:-none}'
${NVCC:+'$NVCC' --version 2>&1 | tail -2}
${SANITIZER:+'$SANITIZER' --version 2>&1 | head -2}
echo '== python'; ${PYTHON:-python3} -c 'import sys; print(sys.version)' 2>&1 || true
${PYTHON:-python3} -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", \".\".join(map(str, torch.cuda.nccl.version())))' 2>&1 || echo '(no torch)'
exit \$rc" ;;
        gpu_cuda) CMD="'$TESTS/gpu_cuda' $f" ;;
        kernels) CMD="env -u LOCKSTEP_NVRTC_OPTIONS '$TESTS/gpu_kernels' $f" ;;
        gpu_train) CMD="env -u LOCKSTEP_NVRTC_OPTIONS '$TESTS/gpu_train' $f" ;;
        kernels_tf32)
            # Set and empty: gpu_kernels keeps the default options (TF32 tensor cores, its wider
            # tolerances), the same cache key as train-cnn's kernels, so nothing recompiles.
            CMD="LOCKSTEP_NVRTC_OPTIONS= '$TESTS/gpu_kernels' $f" ;;
        train_fp32|train_bf16)
            t=no; [ "$s" = train_bf16 ] && t=bf16
            CMD="'$BIN/train-cnn' --device cuda --nprocs 1 --epochs 4 --precision $t --json --data '$data'"
            [ -n "$data" ] || WHY="no FashionMNIST (stage it, or pass --data DIR)" ;;
        nccl)
            # Where two NCCL ranks can run, the test's two-rank check must not skip.
            two_rank_nccl_why > /dev/null && require="LOCKSTEP_REQUIRE_NCCL_TWO_RANKS=1 "
            CMD="${require}'$TESTS/gpu_nccl' $f" ;;
        memcheck|racecheck|racecheck_full)
            t=${s%_full}
            [ "$s" = racecheck ] && [ -z "$f" ] && f=linear
            CMD="unset LOCKSTEP_NVRTC_OPTIONS; '${SANITIZER:-compute-sanitizer}' --tool $t --error-exitcode 1 '$TESTS/gpu_kernels' $f"
            if [ -z "$SANITIZER" ]; then WHY="no compute-sanitizer on this machine"
            else case "$RUNTIME" in gVisor*) WHY="compute-sanitizer refuses gVisor (Device not supported)" ;; esac; fi ;;
        two_ranks_staged)
            CMD="CUDA_VISIBLE_DEVICES=0 NCCL_MULTI_RANK_GPU_ENABLE=0 LOCKSTEP_LOG=lockstep::rendezvous=debug '$BIN/train-cnn' --device cuda --nprocs 2 --epochs 1 --json --data '$data'"
            [ -n "$data" ] || WHY="no FashionMNIST (stage it, or pass --data DIR)" ;;
        recovery)
            CMD="'${PYTHON:-python3}' benches/gpu/recovery.py '$BIN/lockstep' '$BIN/train-cnn' '$data'"
            [ -n "$data" ] || WHY="no FashionMNIST (stage it, or pass --data DIR)" ;;
        two_ranks_nccl)
            [ "$GPUS" -ge 2 ] && multi="CUDA_VISIBLE_DEVICES=0,1 NCCL_MULTI_RANK_GPU_ENABLE=0" || multi="NCCL_MULTI_RANK_GPU_ENABLE=1"
            CMD="$multi LOCKSTEP_LOG=lockstep::rendezvous=debug '$BIN/train-cnn' --device cuda --nprocs 2 --epochs 1 --json --data '$data'"
            WHY=$(two_rank_nccl_why) || true
            if [ -z "$WHY" ] && [ -z "$data" ]; then WHY="no FashionMNIST (stage it, or pass --data DIR)"; fi ;;
        capi)
            CMD="'$stage_abs/capi/capi_test' uid 2 && LOCKSTEP_BACKEND=nccl '$BIN/lockstep' launch --nproc-per-node 2 -- '$stage_abs/capi/capi_cuda'" ;;
        python)
            CMD="d='$work/python'; rm -rf \"\$d\" && mkdir -p \"\$d\" && '${PYTHON:-python3}' -m zipfile -e '$wheel' \"\$d\" && PYTHONPATH=\"\$d\" '${PYTHON:-python3}' benches/gpu/torch_cuda_check.py"
            if [ "$TORCH" != 1 ]; then WHY="python3 has no torch"; elif [ -z "$wheel" ]; then WHY="no wheel in the stage (benches/gpu_stage.sh builds it)"; fi ;;
        baselines|compile_baselines)
            t=compile,lockstep; [ "$s" = compile_baselines ] && t=eager,lockstep
            precisions="fp32 bf16"; [ "$s" = compile_baselines ] && precisions=fp32
            CMD="for p in $precisions; do benches/baselines/gpu_cnn.sh '$BIN/train-cnn' --data '$data' --epochs 2 --skip $t --precision \$p || exit 1; done"
            if [ "$TORCH" != 1 ]; then WHY="python3 has no torch"; elif [ -z "$data" ]; then WHY="no FashionMNIST (stage it, or pass --data DIR)"; fi ;;
        nccl_tests)
            CMD="bash benches/gpu/nccl_tests.sh '$BIN/lockstep' '$stage_abs/nccl-tests.tar.gz' '$work/nccl-tests' '$NVCC' '${PYTHON:-python3}' $GPUS"
            if [ ! -f "$stage_abs/nccl-tests.tar.gz" ]; then WHY="no nccl-tests source in the stage (benches/gpu_stage.sh --nccl-tests DIR)"
            elif [ -z "$NVCC" ]; then WHY="no nvcc to build nccl-tests"
            elif [ "$GPUS" -lt 1 ]; then WHY="no GPU found"
            elif [ "$NCCL_CODE" -le 0 ]; then WHY="lockstep finds no NCCL library"; fi ;;
        bench_raw)
            sizes=8,1024,65536,1048576,16777216
            [ "$GPUS" -lt 2 ] && multi="NCCL_MULTI_RANK_GPU_ENABLE=1 "
            CMD="set -eo pipefail
inc=\$('${PYTHON:-python3}' - <<'PY'
import glob, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for h in sorted(glob.glob(d + '/nvidia/**/include/nccl.h', recursive=True)):
        print(h.rsplit('/include/', 1)[0]); sys.exit()
PY
)
[ -n \"\$inc\" ] || { echo 'no nccl.h in a site-packages nvidia/ wheel'; exit 1; }
lib=\$(ls \"\$inc\"/lib/libnccl.so* | head -1)
echo \"raw NCCL: \$lib\"
'$NVCC' -O2 -o '$work/nccl_raw' benches/baselines/nccl_raw.c -I\"\$inc/include\" \"\$lib\" -Xlinker -rpath=\"\$(dirname \"\$lib\")\"
echo '--- lockstep bench --device cuda ---'
${multi}'$BIN/lockstep' bench --device cuda --nprocs 2 --sizes $sizes -n 300 | tee '$work/bench_lockstep.txt'
echo '--- raw ncclAllReduce ---'
${multi}'$work/nccl_raw' 2 $sizes 300 | tee '$work/bench_raw.txt'
echo '--- per-call overhead (lockstep - raw), median us ---'
awk 'NR == FNR { if (\$1 ~ /^[0-9]+\$/) raw[\$1] = \$2; next } \$1 ~ /^[0-9]+\$/ && (\$1 in raw) { printf \"overhead %s B: lockstep %.2f us, raw %.2f us, +%.2f us\\n\", \$1, \$6, raw[\$1], \$6 - raw[\$1] }' '$work/bench_raw.txt' '$work/bench_lockstep.txt'"
            if ! WHY=$(two_rank_nccl_why); then :
            elif [ -z "$NVCC" ]; then WHY="no nvcc to build the raw NCCL benchmark"
            else WHY=""; fi ;;
    esac
    return 0
}

# Run one step (with its optional test filter) and record it.
do_step() {
    local spec=$1 s=${1%%:*} f="" log rc t0 secs limit left clipped=0 status detail why
    [ "$spec" != "$s" ] && f=${spec#*:}
    log=$work/logs/${spec//[^a-zA-Z0-9_]/_}.log
    plan_step "$s" "$f"
    # Every command must at least parse, whether or not this machine can run it.
    if [ "$dry" = 1 ] && ! bash -n -c "$CMD" > "$log" 2>&1; then
        record "$spec" FAIL 0 "the step's command does not parse: $(head -2 "$log" | tr '\n' ' ')" "$log" "$CMD"
        return 0
    fi
    if [ -n "$WHY" ]; then
        # A dry run's reasons come from this machine (or the simulated GPU), not a lent one.
        [ "$dry" = 1 ] && WHY="dry run: $WHY"
        echo "(not run: $WHY)" > "$log"
        record "$spec" "NOT CHECKED" 0 "$WHY" "$log" "$CMD"
        return 0
    fi
    limit=${LIMIT[$s]}
    if [ "$dry" = 1 ]; then
        if [ "$sim" != 1 ] || [[ "$REHEARSED" != *" $s "* ]]; then
            echo "(dry run: not executed)" > "$log"
            record "$spec" "NOT CHECKED" 0 "dry run: needs a real GPU" "$log" "$CMD"
            return 0
        fi
    elif [ "$budget" -gt 0 ]; then
        left=$((budget - (SECONDS - start) - RESERVE_S))
        if [ "${EST[$s]}" -gt "$left" ]; then
            echo "(not started: estimate ${EST[$s]} s, $left s of the --budget $budget left)" > "$log"
            record "$spec" CUT 0 "budget: not started, estimate ${EST[$s]} s > $left s left" "$log" "$CMD"
            return 0
        fi
        if [ "$left" -lt "$limit" ]; then limit=$left; clipped=1; fi
    fi
    echo "gpu_verify: $spec ... (estimate ${EST[$s]} s, limit $limit s)"
    t0=$SECONDS
    rc=0
    timeout --kill-after=5 "$limit" bash -c "$CMD" > "$log" 2>&1 || rc=$?
    secs=$((SECONDS - t0))
    detail=""
    if [ "$rc" = 0 ]; then
        why=$(post_check "$s" "$log" || true)
        if [ -n "$why" ]; then status=FAIL detail=$why; else status=PASS detail=$(figures "$s" "$log" || true); fi
    elif { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && [ "$secs" -ge $((limit - 1)) ]; then
        if [ "$clipped" = 1 ]; then
            status=CUT detail="budget: stopped after $limit s, at the end of the --budget $budget (estimate ${EST[$s]} s)"
        else
            status=FAIL detail="timed out after its own limit of $limit s (a hang?)"
        fi
    else
        status=FAIL detail="exit $rc; $(grep -E 'FAILED|panicked|error|Error' "$log" | head -2 | tr '\n' ' ')"
    fi
    if [ "$dry" = 1 ]; then
        # A rehearsal on the simulated driver checks the command, the staged binaries and this
        # script's parsing; it says nothing about a GPU.
        if [ "$status" = PASS ]; then status="NOT CHECKED" detail="dry run: needs a real GPU; rehearsed on the simulated driver: ran, ${detail:-ok}"
        else detail="rehearsal on the simulated driver: $detail"; fi
    fi
    record "$spec" "$status" "$secs" "$detail" "$log" "$CMD"
    # Checks a test binary could not run here: their own NOT CHECKED rows.
    sed -n 's/^test \([A-Za-z0-9_]*\) \.\.\. skipped: \(.*\)$/\1\t\2/p' "$log" | while IFS=$'\t' read -r name why; do
        record "$s/$name" "NOT CHECKED" 0 "$why"
    done
    return 0
}

# ---------------------------------------------------------------------------------------------
# The stage: every file the steps run, and binaries that start on this machine's libc.
check_stage() {
    local missing="" f bad="" log=$work/logs/stage.log
    if [ -z "$stage_abs" ]; then
        echo "no stage folder $stage" > "$log"
        record stage FAIL 0 "no stage folder $stage: build one with benches/gpu_stage.sh and carry it" "$log" "ls $stage"
        return 0
    fi
    {
        for f in bin/lockstep bin/train-cnn tests/gpu_cuda tests/gpu_kernels tests/gpu_nccl tests/gpu_train lib/liblockstep.so capi/capi_test capi/capi_cuda; do
            [ -x "$stage_abs/$f" ] || missing="$missing $f"
        done
        [ -n "$wheel" ] || missing="$missing python/lockstep_comm-*.whl"
        [ -f "$stage_abs/MANIFEST" ] || missing="$missing MANIFEST"
        echo "missing:${missing:- nothing}"
        if [ -x "$BIN/lockstep" ]; then "$BIN/lockstep" --version || bad="$bad lockstep"; fi
        if [ -x "$BIN/train-cnn" ]; then "$BIN/train-cnn" --version || bad="$bad train-cnn"; fi
        for f in capi_test capi_cuda; do
            if [ -x "$stage_abs/capi/$f" ] && ldd "$stage_abs/capi/$f" 2>&1 | grep -q 'not found'; then bad="$bad $f"; ldd "$stage_abs/capi/$f"; fi
        done
        echo "do not start here:${bad:- none}"
        if [ -n "$data" ]; then echo "data: $data"; else echo "data: none (the train and baseline steps will say NOT CHECKED)"; fi
        cat "$stage_abs/MANIFEST" 2>/dev/null || true
    } > "$log" 2>&1
    missing=$(sed -n 's/^missing: *//p' "$log")
    bad=$(sed -n 's/^do not start here: *//p' "$log")
    if [ "$missing" != nothing ] || [ "$bad" != none ]; then
        record stage FAIL 0 "missing: $missing; do not start here: $bad" "$log" "check $stage"
    else
        record stage PASS 0 "every file there; the binaries start here" "$log" "check $stage"
    fi
}

# ---------------------------------------------------------------------------------------------
# The dry run's checks of the plan against the device tool's limits.
sum_est() { local s n=0; for s in "$@"; do n=$((n + EST[${s%%:*}])); done; echo "$n"; }

check_plan() {
    local main second fits="" s left problems="" log=$work/logs/plan.log
    main=$(sum_est "${MAIN_STEPS[@]}")
    second=$(sum_est "${SECOND_STEPS[@]}")
    for s in "${MAIN_STEPS[@]}" "${SECOND_STEPS[@]}"; do
        [ "${EST[$s]}" -le "${LIMIT[$s]}" ] || problems="$problems $s: estimate over its limit;"
    done
    [ "$main" -le $((MAIN_BUDGET - RESERVE_S)) ] || problems="$problems main estimates $main s > $((MAIN_BUDGET - RESERVE_S)) s;"
    [ $((MAIN_BUDGET + 60)) -le "$TOOL_TIMEOUT_S" ] || problems="$problems main budget leaves under 60 s of the tool's $TOOL_TIMEOUT_S s;"
    [ $((SECOND_BUDGET + 60)) -le "$TOOL_TIMEOUT_S" ] || problems="$problems second budget leaves under 60 s of the tool's $TOOL_TIMEOUT_S s;"
    local device=$((ASSUMED_START_S + MAIN_BUDGET + TOOL_WARM_S + SECOND_BUDGET + ASSUMED_RELEASE_S))
    [ "$device" -le "$TOOL_DEVICE_S" ] || problems="$problems device time $device s > $TOOL_DEVICE_S s;"
    left=$((SECOND_BUDGET - RESERVE_S))
    for s in "${SECOND_STEPS[@]}"; do
        if [ "${EST[$s]}" -le "$left" ]; then fits="$fits $s"; left=$((left - EST[$s])); fi
    done
    {
        echo "main run: $main s of estimates for ${#MAIN_STEPS[@]} steps, budget $MAIN_BUDGET s (less $RESERVE_S s reserve), device call timeout_s $TOOL_TIMEOUT_S"
        echo "second run: $second s of estimates for ${#SECOND_STEPS[@]} steps, budget $SECOND_BUDGET s: starts${fits:- none} when every step runs (the others CUT)"
        echo "device time: ~$ASSUMED_START_S s start + $MAIN_BUDGET s + $TOOL_WARM_S s warm gap + $SECOND_BUDGET s + ~$ASSUMED_RELEASE_S s release = $device s of $TOOL_DEVICE_S s"
        echo "problems:${problems:- none}"
    } > "$log"
    if [ -n "$problems" ]; then record plan FAIL 0 "$problems" "$log" "budget arithmetic"
    else record plan PASS 0 "main $main s <= $((MAIN_BUDGET - RESERVE_S)) s; device time $device s <= $TOOL_DEVICE_S s" "$log" "budget arithmetic"; fi
}

check_commands() {
    local log=$work/logs/commands.log problems="" c
    {
        for c in "$MAIN_COMMAND" "$SECOND_COMMAND"; do
            echo "${#c} characters: $c"
            [ "${#c}" -le "$TOOL_COMMAND_CHARS" ] || problems="$problems over $TOOL_COMMAND_CHARS characters: $c;"
            if [ -f docs/gpu.md ]; then grep -qF -- "$c" docs/gpu.md || problems="$problems not in docs/gpu.md: $c;"
            else problems="$problems docs/gpu.md missing;"; fi
        done
        grep -qF -- "$CARRY" docs/gpu.md 2>/dev/null || problems="$problems carry path $CARRY not in docs/gpu.md;"
        echo "carry: [\"$CARRY\"] (1 path of the tool's 8); this run's stage: $stage"
        echo "problems:${problems:- none}"
    } > "$log"
    problems=$(sed -n 's/^problems: *//p' "$log")
    if [ "$problems" != none ]; then record commands FAIL 0 "$problems" "$log" "device commands"
    else record commands PASS 0 "both commands <= $TOOL_COMMAND_CHARS characters and in docs/gpu.md; carry [\"$CARRY\"]" "$log" "device commands"; fi
}

# The scripts the device runs but no rehearsal reaches: their syntax, at least.
check_scripts() {
    local log=$work/logs/scripts.log problems="" f py=${PYTHON:-python3}
    {
        for f in benches/gpu/torch_cuda_check.py benches/baselines/gpu_cnn.py benches/baselines/cnn_common.py; do
            "$py" -c 'import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])' "$f" || problems="$problems $f;"
        done
        for f in benches/baselines/gpu_cnn.sh benches/gpu/common.sh; do bash -n "$f" || problems="$problems $f;"; done
        echo "problems:${problems:- none}"
    } > "$log" 2>&1
    problems=$(sed -n 's/^problems: *//p' "$log")
    if [ "$problems" = none ]; then record scripts PASS 0 "the Python check and the baselines parse" "$log" "syntax of the scripts"
    else record scripts FAIL 0 "syntax errors in: $problems" "$log" "syntax of the scripts"; fi
}

check_travel() {
    local log=$work/logs/travel.log tree st sum
    if ! command -v git >/dev/null || ! git rev-parse --git-dir >/dev/null 2>&1; then
        record travel "NOT CHECKED" 0 "no git here to list the working tree" "$log" "size of the stage and the tree"
        return 0
    fi
    tree=$(gpu_tree_bytes)
    st=$stage_travel_bytes
    sum=$((tree + st))
    echo "stage $st bytes + tree $tree bytes = $sum bytes; limit $GPU_TRAVEL_LIMIT bytes" > "$log"
    local what
    what="stage $(gpu_mib "$st") MiB + tree $(gpu_mib "$tree") MiB = $(gpu_mib "$sum") MiB of ${GPU_TRAVEL_LIMIT_MIB} MiB"
    if [ "$sum" -le "$GPU_TRAVEL_LIMIT" ]; then record travel PASS 0 "$what" "$log" "size of the stage and the tree"
    else record travel FAIL 0 "$what" "$log" "size of the stage and the tree"; fi
}

# The result files under $OUT: at most 8, 16 MiB each, named in [A-Za-z0-9._-], at most two
# folders down.
check_results() {
    local problems="" n f rel
    n=$(find "$out" -type f | wc -l)
    [ "$n" -le "$TOOL_OUT_FILES" ] || problems="$problems $n files;"
    while IFS= read -r f; do
        rel=${f#"$out"/}
        [[ "$rel" =~ ^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+){0,2}$ ]] || problems="$problems bad name or depth: $rel;"
        [ "$(stat -c %s "$f")" -le "$TOOL_OUT_FILE_BYTES" ] || problems="$problems over 16 MiB: $rel;"
    done < <(find "$out" -type f)
    for f in "${OUT_FILES[@]}"; do [ -f "$out/$f" ] || problems="$problems missing $f;"; done
    echo "${problems:-ok}"
}

# ---------------------------------------------------------------------------------------------
# A carried stage whose execute bits were lost would fail every step for a reason of no interest.
if [ "$dry" = 0 ] && [ -n "$stage_abs" ]; then
    for f in "$stage_abs"/bin/* "$stage_abs"/tests/* "$stage_abs"/capi/*; do
        if [ -f "$f" ] && [ ! -x "$f" ]; then chmod u+x "$f"; fi
    done
fi
probe_facts
echo "gpu_verify: machine:"
sed 's/^/  /' "$facts"
check_stage
[ "$dry" = 1 ] && [ "$sim" != 1 ] && echo "gpu_verify: dry run without rehearsals: $sim_why"
if [ "$dry" = 0 ]; then
    echo "gpu_verify: planned: $(sum_est "${walk[@]}") s for ${#walk[@]} steps$([ "$budget" -gt 0 ] && echo ", --budget $budget s")"
fi
for s in "${walk[@]}"; do do_step "$s"; done

if [ "$dry" = 1 ]; then
    check_plan
    check_commands
    check_scripts
    check_travel
    results=$(check_results)
    if [ "$results" = ok ]; then record results PASS 0 "${OUT_FILES[*]} under \$OUT, within the tool's limits"
    else record results FAIL 0 "$results"; fi
fi

echo
echo "gpu_verify: summary of this machine's runs ($report${out:+, mirrored in $out}):"
awk -F'\t' '{ printf "  %-34s %-12s %5s s  %s\n", $1, $2, $3, substr($5, 1, 110) }' "$summary"
echo "gpu_verify: time used: $((SECONDS - start)) s$([ "$budget" -gt 0 ] && [ "$dry" = 0 ] && echo " of the --budget $budget s")"
if [ "$dry" = 1 ]; then
    echo "second run (optional, on the warm machine): $(sum_est "${SECOND_STEPS[@]}") s of estimates for ${#SECOND_STEPS[@]} steps, as many as its --budget $SECOND_BUDGET allows"
    echo "planned: $(sum_est "${MAIN_STEPS[@]}") s for ${#MAIN_STEPS[@]} steps"
fi
exit "$failed"
