#!/usr/bin/env bash
# One command that verifies lockstep on a GPU machine, from binaries built elsewhere
# (benches/gpu_stage.sh) and carried over: the machine needs a CUDA driver, and for some steps
# PyTorch (its NCCL wheel, torch.compile), nvcc and compute-sanitizer; no Rust, no network.
#
#   benches/gpu_verify.sh [--stage DIR] [--data DIR] [--only STEP[,STEP...]] [--budget SECONDS]
#                         [--fresh] [--dry-run] [--list]
#
# Every step runs even when an earlier one failed; each is recorded in ONE report file,
# rewritten after every step (so a run cut short still leaves what it did):
#   $OUT/gpu_verify_report.md when OUT is set (the device tool's output folder), and always
#   .device/gpu_verify_report.md, which accumulates over invocations until --fresh: the device
#   tool allows 600 s per command, so run the steps in groups (--only, --budget) on one warm
#   machine and the last report holds them all.
#
# Steps (name: what; rough time on an H100):
#   env            lockstep env (which driver/NVRTC/NCCL and why), nvidia-smi, torch versions   5 s
#   nvrtc          every kernel compiled by this machine's own NVRTC (PTX sm_80/90, CUBIN)    30 s
#   gpu_cuda       tests/gpu_cuda: contexts, memory, streams, graphs, the init guard          20 s
#   kernels        tests/gpu_kernels, TF32 off: every kernel against its CPU twin             60 s
#   kernels_tf32   tests/gpu_kernels, TF32 on (LOCKSTEP_NVRTC_OPTIONS without NO_TF32)        60 s
#   memcheck       compute-sanitizer --tool memcheck on gpu_kernels                          300 s
#   racecheck      compute-sanitizer --tool racecheck on gpu_kernels                         300 s
#   nccl           tests/gpu_nccl: every collective, aborts, two ranks when 2+ GPUs           60 s
#   gpu_train      tests/gpu_train: GPU vs CPU engine, bit-identical runs, train-cnn          300 s
#   bench          lockstep bench --device cuda, 2 ranks, against the raw NCCL call (nvcc)    90 s
#   train_fp32     train-cnn --device cuda, fp32, 4 epochs (goal: >= 90 % test accuracy)      60 s
#   train_bf16     the same in bf16 (goal: >= 1.3x the fp32 images/s)                         60 s
#   two_ranks      train-cnn, 2 ranks on one GPU: staged, then NCCL's multi-rank mode         120 s
#   baselines      benches/baselines/gpu_cnn.sh: PyTorch eager, torch.compile, train-cnn      400 s
#   baselines_bf16 the same with --precision bf16                                            400 s
# A step may carry a filter for the gpu_* test binaries: --only memcheck:conv2d runs only the
# checks whose name contains "conv2d".
#
# --dry-run (no GPU needed; CI-safe): checks the stage, runs env and nvrtc for real, and prints
# the command of every other step. --budget S: never start a step that could run past S seconds
# from now (it is recorded as not run), so a device call does not hit its limit mid-step.
#
# The gpu_* tests run with LOCKSTEP_REQUIRE_GPU=1 (a missing GPU or NCCL is a failure, not a
# skip) and nvrtc with LOCKSTEP_REQUIRE_NVRTC=1.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

stage=.device/stage
data=""
only=""
budget=0
fresh=0
dry=0
all_steps="env nvrtc gpu_cuda kernels kernels_tf32 memcheck racecheck nccl gpu_train bench train_fp32 train_bf16 two_ranks baselines baselines_bf16"
while [ $# -gt 0 ]; do
    case "$1" in
        --stage) stage=$2; shift ;;
        --data) data=$2; shift ;;
        --only) only=$2; shift ;;
        --budget) budget=$2; shift ;;
        --fresh) fresh=1 ;;
        --dry-run) dry=1 ;;
        --list) echo "$all_steps" | tr ' ' '\n'; exit 0 ;;
        -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
        *) echo "gpu_verify: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
steps=${only:-$all_steps}
steps=${steps//,/ }
for s in $steps; do
    case " $all_steps " in *" ${s%%:*} "*) ;; *) echo "gpu_verify: unknown step ${s%%:*} (see --list)" >&2; exit 2 ;; esac
done

stage=$(cd "$stage" 2>/dev/null && pwd) || { echo "gpu_verify: no stage folder: build one with benches/gpu_stage.sh and carry it" >&2; exit 2; }
if [ -z "$data" ]; then
    for d in "$stage/data/fashion-mnist" /usr/share/datasets/fashion-mnist; do
        if [ -f "$d/train-images-idx3-ubyte.gz" ] || [ -f "$d/train-images-idx3-ubyte" ]; then data=$d; break; fi
    done
fi
BIN=$stage/bin
TESTS=$stage/tests
state=.device
mkdir -p "$state"
sections=$state/gpu_verify_sections.md
summary=$state/gpu_verify_summary.tsv
report=$state/gpu_verify_report.md
work=$state/gpu_verify_work
mkdir -p "$work"
if [ "$fresh" = 1 ]; then rm -f "$sections" "$summary" "$report"; fi
touch "$sections" "$summary"
start=$SECONDS
export LOCKSTEP_REQUIRE_GPU=1 LOCKSTEP_REQUIRE_NVRTC=1 LOCKSTEP_TRAIN_CNN=$BIN/train-cnn
# A private kernel cache, so the report measures compiles and never a stale image.
export XDG_CACHE_HOME=$work/cache

# One figure line for the summary, from a step's output (test counts, accuracies, speeds).
figures() {
    local step=$1 log=$2
    case "$step" in
        train_fp32|train_bf16|two_ranks)
            python3 - "$log" <<'EOF' 2>/dev/null
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
    print(f'{len(rows)} epochs; final test acc {last["test_acc"]:.2f} %; {sum(speeds)/len(speeds):.0f} img/s (mean after epoch 1); epoch {last["epoch_s"]:.2f} s')
EOF
            ;;
        bench) grep -E '^overhead' "$log" | tr '\n' ';' ;;
        baselines|baselines_bf16) grep -E 'eager|compile|lockstep|train-cnn' "$log" | tail -4 | tr -s ' ' | tr '\n' ';' ;;
        env) grep -E 'chosen:|nvrtcVersion|ncclGetVersion|cuDriverGetVersion' "$log" | sed 's/^ *//' | tr '\n' ';' | cut -c1-400 ;;
        *) grep -E '^test result|^skipped|ERROR SUMMARY' "$log" | tail -2 | tr '\n' ';' ;;
    esac
}

# Rewrite the report from the summary and the sections; mirror it into $OUT.
write_report() {
    {
        echo "# lockstep GPU verification"
        echo
        echo "- machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo 'no nvidia-smi') on $(uname -srm)"
        echo "- stage: $(head -2 "$stage/MANIFEST" 2>/dev/null | tail -1)"
        echo "- report updated $(date -u +%Y-%m-%dT%H:%M:%SZ); steps run so far, newest last:"
        echo
        echo "| step | result | seconds | figures |"
        echo "|---|---|---|---|"
        awk -F'\t' '{ printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4 }' "$summary"
        echo
        cat "$sections"
    } > "$report"
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT" && cp "$report" "$OUT/gpu_verify_report.md"
    fi
}

# record STEP RESULT SECONDS LOG COMMAND
record() {
    local step=$1 result=$2 secs=$3 log=$4 cmd=$5 fig
    fig=$(figures "${step%%:*}" "$log" | tr '\t|' '  ')
    printf '%s\t%s\t%s\t%s\n' "$step" "$result" "$secs" "$fig" >> "$summary"
    {
        echo "## $step: $result ($secs s)"
        echo
        echo '```'
        echo "\$ $cmd"
        # The whole output of short steps; the head and the tail of long ones.
        if [ "$(wc -l < "$log")" -le 400 ]; then cat "$log"; else head -100 "$log"; echo "... ($(wc -l < "$log") lines, middle left out) ..."; tail -250 "$log"; fi
        echo '```'
        echo
    } >> "$sections"
    write_report
    echo "gpu_verify: $step: $result ($secs s)${fig:+ -- $fig}"
}

# run STEP LIMIT_S COMMAND...: run with a time limit (within the budget), record the result.
run() {
    local step=$1 limit=$2
    shift 2
    local cmd="$*" log="$work/${step//[^a-zA-Z0-9_]/_}.log"
    if [ "$budget" -gt 0 ]; then
        local left=$((budget - (SECONDS - start) - 10))
        if [ "$left" -lt 30 ]; then
            echo "(not started: $left s of the --budget left, the step may need $limit s)" > "$log"
            record "$step" "NOT RUN (budget)" 0 "$log" "$cmd"
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "gpu_verify: $step ..."
    local t0=$SECONDS rc
    timeout --kill-after=15 "$limit" bash -c "$cmd" > "$log" 2>&1
    rc=$?
    local secs=$((SECONDS - t0)) result
    case $rc in
        0) result=PASS ;;
        124|137) result="FAIL (timed out after $limit s)" ;;
        *) result="FAIL (exit $rc)" ;;
    esac
    record "$step" "$result" "$secs" "$log" "$cmd"
}

# dry STEP COMMAND...: what the step would run (no GPU here).
dry() {
    local step=$1
    shift
    local log="$work/${step//[^a-zA-Z0-9_]/_}.log"
    echo "(dry run: not executed)" > "$log"
    record "$step" "NOT RUN (dry run)" 0 "$log" "$*"
}

gpus() {
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    echo "${n:-0}"
}

# The raw NCCL benchmark, compiled here with nvcc against PyTorch's NCCL wheel (or a system NCCL).
nccl_raw_cmd() {
    cat <<'EOF'
set -e
inc=$(python3 - <<'PY' 2>/dev/null
import glob, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for h in glob.glob(d + "/nvidia/nccl/include/nccl.h"):
        print(h.rsplit("/include/", 1)[0]); sys.exit()
PY
)
if [ -n "$inc" ]; then lib=$(ls "$inc"/lib/libnccl.so* | head -1); cflags="-I$inc/include"; else lib=$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}'); cflags=""; fi
[ -n "$lib" ] || { echo "no NCCL (PyTorch's nvidia/nccl wheel or libnccl2) to build the raw benchmark"; exit 1; }
echo "raw NCCL: $lib"
nvcc -O2 -o "$WORK/nccl_raw" benches/baselines/nccl_raw.c $cflags "$lib" -Xlinker -rpath="$(dirname "$lib")"
EOF
}

for s in $steps; do
    step=${s%%:*}
    filter=""
    [ "$s" != "$step" ] && filter=${s#*:}
    case "$step" in
        env)
            run env 60 "'$BIN/lockstep' env; nvidia-smi || true; python3 -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", torch.cuda.nccl.version())' || true" ;;
        nvrtc)
            run nvrtc 300 "'$TESTS/nvrtc_kernels'" ;;
        gpu_cuda)
            if [ "$dry" = 1 ]; then dry "$s" "'$TESTS/gpu_cuda' $filter"; else run "$s" 300 "'$TESTS/gpu_cuda' $filter"; fi ;;
        kernels)
            c="env -u LOCKSTEP_NVRTC_OPTIONS '$TESTS/gpu_kernels' $filter"
            if [ "$dry" = 1 ]; then dry "$s" "$c"; else run "$s" 300 "$c"; fi ;;
        kernels_tf32)
            # gpu_kernels turns TF32 off only when LOCKSTEP_NVRTC_OPTIONS is unset: any other
            # value keeps the default TF32 tensor-core path (and its wider tolerances).
            c="LOCKSTEP_NVRTC_OPTIONS=-DLOCKSTEP_TF32_DEFAULT '$TESTS/gpu_kernels' $filter"
            if [ "$dry" = 1 ]; then dry "$s" "$c"; else run "$s" 300 "$c"; fi ;;
        memcheck|racecheck)
            # The test binary itself under the sanitizer (no wrapper process in between).
            c="unset LOCKSTEP_NVRTC_OPTIONS; compute-sanitizer --tool $step --error-exitcode 1 '$TESTS/gpu_kernels' $filter"
            if [ "$dry" = 1 ]; then dry "$s" "$c"; else run "$s" 560 "$c"; fi ;;
        nccl)
            if [ "$dry" = 1 ]; then dry "$s" "'$TESTS/gpu_nccl' $filter"; else run "$s" 300 "'$TESTS/gpu_nccl' $filter"; fi ;;
        gpu_train)
            c="env -u LOCKSTEP_NVRTC_OPTIONS '$TESTS/gpu_train' $filter"
            if [ "$dry" = 1 ]; then dry "$s" "$c"; else run "$s" 560 "$c"; fi ;;
        bench)
            # Two ranks: NCCL on two GPUs, or NCCL's multi-rank mode on one (NCCL >= 2.30).
            sizes=8,1024,65536,1048576,16777216
            multi=""
            [ "$(gpus)" -lt 2 ] && multi="NCCL_MULTI_RANK_GPU_ENABLE=1"
            c="set -o pipefail; WORK='$work'; $(nccl_raw_cmd)
echo '--- lockstep bench --device cuda ---'
$multi '$BIN/lockstep' bench --device cuda --nprocs 2 --sizes $sizes --iters 300 -v 2>&1 | tee '$work/bench_lockstep.txt'
echo '--- raw ncclAllReduce ---'
$multi \"\$WORK/nccl_raw\" 2 $sizes 300 | tee '$work/bench_raw.txt'
echo '--- per-call overhead (lockstep - raw), median us ---'
awk 'NR==FNR { if (\$1 ~ /^[0-9]+\$/) raw[\$1] = \$2; next } \$1 ~ /^[0-9]+\$/ && (\$1 in raw) { printf \"overhead %s B: lockstep %.2f us, raw %.2f us, +%.2f us\\n\", \$1, \$5, raw[\$1], \$5 - raw[\$1] }' '$work/bench_raw.txt' '$work/bench_lockstep.txt'"
            if [ "$dry" = 1 ]; then dry "$s" "$c"; else run "$s" 300 "$c"; fi ;;
        train_fp32|train_bf16)
            p=${step#train_}
            c="'$BIN/train-cnn' --device cuda --nprocs 1 --epochs 4 --precision $p --json --data '$data'"
            if [ "$dry" = 1 ]; then dry "$s" "$c"; else run "$s" 300 "$c"; fi ;;
        two_ranks)
            c="echo '--- staged (shared-memory staging) ---'; NCCL_MULTI_RANK_GPU_ENABLE=0 '$BIN/train-cnn' --device cuda --nprocs 2 --epochs 1 --json -v --data '$data' && echo '--- NCCL multi-rank mode (NCCL_MULTI_RANK_GPU_ENABLE=1) ---' && NCCL_MULTI_RANK_GPU_ENABLE=1 '$BIN/train-cnn' --device cuda --nprocs 2 --epochs 1 --json -v --data '$data'"
            if [ "$dry" = 1 ]; then dry "$s" "$c"; else run "$s" 400 "$c"; fi ;;
        baselines|baselines_bf16)
            p=fp32
            [ "$step" = baselines_bf16 ] && p=bf16
            c="benches/baselines/gpu_cnn.sh '$BIN/train-cnn' --data '$data' --precision $p"
            if [ "$dry" = 1 ]; then dry "$s" "$c"; else run "$s" 560 "$c"; fi ;;
    esac
done

# Stage check (dry runs and real ones): every binary is there and runs on this machine's libc.
missing=""
for f in "$BIN/lockstep" "$BIN/train-cnn" "$TESTS/gpu_cuda" "$TESTS/gpu_kernels" "$TESTS/gpu_nccl" "$TESTS/gpu_train" "$TESTS/nvrtc_kernels"; do
    [ -x "$f" ] || missing="$missing $f"
done
[ -z "$data" ] && echo "gpu_verify: no FashionMNIST found (stage it, or pass --data DIR): the train and baseline steps fail without it" >&2
if [ -n "$missing" ]; then echo "gpu_verify: missing from the stage:$missing" >&2; fi
echo "gpu_verify: report: $report${OUT:+ and $OUT/gpu_verify_report.md}"
if grep -q $'\tFAIL' "$summary" || [ -n "$missing" ]; then exit 1; fi
exit 0
