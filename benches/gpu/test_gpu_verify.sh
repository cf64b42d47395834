#!/usr/bin/env bash
# shellcheck disable=SC2016,SC2034  # expectations are strings that expect() evals later, after rc is set
# Tests of benches/gpu_verify.sh's statuses, without a GPU and without building anything: a fake
# stage (shell scripts standing in for the binaries, a fake nvidia-smi on PATH) whose behaviour
# each case sets through FAKE_* variables, and small fake budgets.
#
#   benches/gpu/test_gpu_verify.sh
#
# Cases:
#   budget_cut_is_not_a_failure      a step stopped by the budget and one not started are CUT,
#                                    and the script exits 0
#   own_limit_is_a_failure           a step past its own time limit (not the budget) is FAIL
#   failure_exits_1_with_cuts        a real failure still exits 1 next to CUT steps
#   one_gpu_old_nccl_not_checked     one GPU, NCCL 2.28.9: two NCCL ranks, the raw NCCL bench and
#                                    the two-rank case inside gpu_nccl are NOT CHECKED, never PASS
#   one_gpu_nccl_230_runs            one GPU, NCCL 2.30: multi-rank mode runs and must show
#   nccl_230_staged_is_a_failure     ... a run that staged instead of using NCCL is FAIL
#   two_gpus_old_nccl_runs           two GPUs, NCCL 2.28.9: one GPU per rank runs
#   gpu_nccl_skip_on_simulated_gpu   the real tests/gpu_nccl binary on the simulated driver and
#                                    NCCL 2.28.9: its two-rank check prints a skip and is not
#                                    counted as passed; LOCKSTEP_REQUIRE_NCCL_TWO_RANKS=1 fails it
#                                    (skipped without the binary or a C compiler)
# Ends with the line "N passed, N failed, N skipped"; exits 1 when a case failed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
tmp=$(mktemp -d /tmp/lockstep-gpu-verify-test.XXXXXX)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
passed=0 failed=0 skipped=0

# ---------------------------------------------------------------------------------------------
# The fake stage and machine.
stage=$tmp/stage
fakebin=$tmp/fakebin
data=$tmp/data
mkdir -p "$stage/bin" "$stage/tests" "$stage/lib" "$stage/capi" "$stage/python" "$fakebin" "$data"
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do : > "$data/$f"; done
echo "revision: fake" > "$stage/MANIFEST"
: > "$stage/python/lockstep_comm-0.0.0-cp39-abi3-linux_x86_64.whl"

script() { cat > "$1"; chmod +x "$1"; }

script "$fakebin/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
case "${1:-}" in
    -L) for ((i = 0; i < ${FAKE_GPUS:-1}; i++)); do echo "GPU $i: Fake GPU (UUID: GPU-$i)"; done ;;
    --query-gpu=*) for ((i = 0; i < ${FAKE_GPUS:-1}; i++)); do echo "$i, Fake GPU, 1.0, Default, 1 MiB"; done ;;
    *) echo "fake nvidia-smi" ;;
esac
EOF

script "$stage/bin/lockstep" <<'EOF'
#!/usr/bin/env bash
case "${1:-}" in
    --version) echo "lockstep (fake)" ;;
    env)
        code=${FAKE_NCCL:-22809}
        echo "lockstep CUDA environment"
        echo "  driver : /fake/libcuda.so.1 (found via the test)"
        echo "           chosen: fake"
        echo "  nccl   : /fake/libnccl.so.2 (found via the test)"
        echo "           chosen: fake"
        echo "           ncclGetVersion = $code ($((code / 10000)).$((code / 100 % 100)).$((code % 100)))"
        ;;
    *) echo "fake lockstep $*" ;;
esac
EOF

# train-cnn: the device backend policy of src/rendezvous/select.rs, as its debug lines say it.
script "$stage/bin/train-cnn" <<'EOF'
#!/usr/bin/env bash
[ "${1:-}" = --version ] && { echo "train-cnn (fake)"; exit 0; }
n=1
while [ $# -gt 0 ]; do [ "$1" = --nprocs ] && n=$2; shift; done
gpus=${FAKE_GPUS:-1}
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
if [ -n "${FAKE_TRAIN_CHOICE:-}" ]; then choice=$FAKE_TRAIN_CHOICE
elif [ "$n" -le 1 ]; then choice=Staged
elif [ "$gpus" -ge "$n" ]; then choice="Nccl { multi_rank: false }"
elif [ "${NCCL_MULTI_RANK_GPU_ENABLE:-}" = 1 ] && [ "${FAKE_NCCL:-22809}" -ge 23000 ]; then choice="Nccl { multi_rank: true }"
else choice=Staged; fi
for ((r = 0; r < n; r++)); do echo "DEBUG device backend selected rank=$r world=$n gpus=$gpus device=0 choice=$choice" >&2; done
echo '{"epoch":1,"epochs":1,"train_loss":0.5,"test_acc":85.0,"test_count":10000,"epoch_s":1.0,"images_per_s":60000.0,"steps":938}'
EOF

# The gpu_* tests: FAKE_SLEEP_<name> seconds, then pass, or fail with FAKE_FAIL_<name>=1.
for t in gpu_cuda gpu_kernels gpu_train; do
    script "$stage/tests/$t" <<EOF
#!/usr/bin/env bash
sleep "\${FAKE_SLEEP_$t:-0}"
if [ "\${FAKE_FAIL_$t:-0}" = 1 ]; then echo "test check ... FAILED"; echo "test result: FAILED. 0 passed; 1 failed"; exit 1; fi
echo "test check ... ok"; echo "test result: ok. 1 passed; 0 failed"
EOF
done
# gpu_nccl: the two-rank check as tests/gpu_nccl.rs decides it.
script "$stage/tests/gpu_nccl" <<'EOF'
#!/usr/bin/env bash
if [ "${FAKE_GPUS:-1}" -ge 2 ] || [ "${FAKE_NCCL:-22809}" -ge 23000 ]; then
    echo "test two_ranks_and_peer_loss ... ok"; n=2
elif [ "${LOCKSTEP_REQUIRE_NCCL_TWO_RANKS:-}" = 1 ]; then
    echo "test two_ranks_and_peer_loss ... FAILED"; exit 1
else
    echo "test two_ranks_and_peer_loss ... skipped: one GPU and NCCL 2.28.9 (older than 2.30): fake"; n=1
fi
echo "test collectives_ops_dtypes_world1 ... ok"
echo "test result: ok. $n passed; 0 failed"
EOF
for f in lib/liblockstep.so capi/capi_test capi/capi_cuda; do script "$stage/$f" <<< '#!/usr/bin/env bash'; done

# verify NAME ARGS...: run gpu_verify.sh on the fake stage; its exit code in $rc, its summary in
# $tsv (step<TAB>status<TAB>seconds<TAB>estimate<TAB>detail).
verify() {
    local name=$1
    shift
    local st=$tmp/state-$name
    rc=0
    PATH="$fakebin:$PATH" OUT=$tmp/out-$name bash benches/gpu_verify.sh --stage "$stage" --data "$data" --state "$st" --fresh "$@" \
        > "$tmp/$name.log" 2>&1 || rc=$?
    tsv=$st/gpu_verify_summary.tsv
}

# status STEP: the status of STEP's row.
status() { awk -F'\t' -v s="$1" '$1 == s { print $2 }' "$tsv"; }
detail() { awk -F'\t' -v s="$1" '$1 == s { print $5 }' "$tsv"; }

# expect CASE CONDITION-DESCRIPTION: evaluated by the caller; collects failures per case.
problems=""
expect() { if ! eval "$2"; then problems="$problems\n  expected: $1 [$2]"; fi; }
finish() {
    local name=$1
    if [ -z "$problems" ]; then
        echo "ok $name"
        passed=$((passed + 1))
    else
        echo -e "FAILED $name$problems"
        echo "  --- output:"; sed 's/^/  | /' "$tmp/$name.log" | tail -40
        failed=$((failed + 1))
    fi
    problems=""
}

# ---------------------------------------------------------------------------------------------
# The fake gpu_cuda sleeps past the budget; kernels' estimate exceeds what is left.
FAKE_SLEEP_gpu_cuda=60 verify budget_cut_is_not_a_failure --only env,gpu_cuda,kernels --budget 15 --estimates env=1,gpu_cuda=1,kernels=30
expect "exit 0" '[ "$rc" = 0 ]'
expect "env PASS" '[ "$(status env)" = PASS ]'
expect "gpu_cuda CUT" '[ "$(status gpu_cuda)" = CUT ]'
expect "kernels CUT (not started)" '[ "$(status kernels)" = CUT ] && detail kernels | grep -q "not started"'
expect "no FAIL row" '! grep -q "	FAIL	" "$tsv"'
expect "report says CUT" 'grep -q "| gpu_cuda | CUT |" "$(dirname "$tsv")/gpu_verify_report.md"'
expect "report mirrored in OUT" '[ -f "$tmp/out-budget_cut_is_not_a_failure/gpu_verify_report.md" ]'
finish budget_cut_is_not_a_failure

FAKE_SLEEP_gpu_cuda=60 verify own_limit_is_a_failure --only gpu_cuda --budget 0 --estimates gpu_cuda=1:2
expect "exit 1" '[ "$rc" = 1 ]'
expect "gpu_cuda FAIL (timed out)" '[ "$(status gpu_cuda)" = FAIL ] && detail gpu_cuda | grep -q "its own limit of 2 s"'
finish own_limit_is_a_failure

FAKE_FAIL_gpu_kernels=1 verify failure_exits_1_with_cuts --only kernels,gpu_train --budget 12 --estimates kernels=1,gpu_train=100
expect "exit 1" '[ "$rc" = 1 ]'
expect "kernels FAIL" '[ "$(status kernels)" = FAIL ]'
expect "gpu_train CUT" '[ "$(status gpu_train)" = CUT ]'
finish failure_exits_1_with_cuts

two_rank_steps=nccl,two_ranks_staged,two_ranks_nccl,bench_raw
FAKE_GPUS=1 FAKE_NCCL=22809 verify one_gpu_old_nccl_not_checked --only $two_rank_steps --budget 0
expect "exit 0" '[ "$rc" = 0 ]'
expect "two_ranks_nccl NOT CHECKED, naming 2.28.9 and 2.30" '[ "$(status two_ranks_nccl)" = "NOT CHECKED" ] && detail two_ranks_nccl | grep -q "2.28.9" && detail two_ranks_nccl | grep -q "2.30"'
expect "bench_raw NOT CHECKED" '[ "$(status bench_raw)" = "NOT CHECKED" ]'
expect "nccl's two-rank case NOT CHECKED" '[ "$(status nccl/two_ranks_and_peer_loss)" = "NOT CHECKED" ]'
expect "nccl itself PASS (world size 1)" '[ "$(status nccl)" = PASS ]'
expect "staged PASS" '[ "$(status two_ranks_staged)" = PASS ]'
expect "no two-rank NCCL row PASS" '! awk -F"\t" "\$1 ~ /two_ranks_nccl|two_ranks_and_peer_loss|bench_raw/ && \$2 == \"PASS\"" "$tsv" | grep -q .'
expect "facts name the NCCL version" 'grep -q "nccl: 2.28.9" "$tmp/out-one_gpu_old_nccl_not_checked/gpu_verify_facts.txt"'
finish one_gpu_old_nccl_not_checked

FAKE_GPUS=1 FAKE_NCCL=23000 verify one_gpu_nccl_230_runs --only nccl,two_ranks_nccl --budget 0
expect "exit 0" '[ "$rc" = 0 ]'
expect "two_ranks_nccl PASS" '[ "$(status two_ranks_nccl)" = PASS ]'
expect "nccl required the two-rank case" '[ "$(status nccl)" = PASS ] && [ -z "$(status nccl/two_ranks_and_peer_loss)" ] && grep -q "LOCKSTEP_REQUIRE_NCCL_TWO_RANKS=1" "$(dirname "$tsv")/gpu_verify_report.md"'
finish one_gpu_nccl_230_runs

FAKE_GPUS=1 FAKE_NCCL=23000 FAKE_TRAIN_CHOICE=Staged verify nccl_230_staged_is_a_failure --only two_ranks_nccl --budget 0
expect "exit 1" '[ "$rc" = 1 ]'
expect "two_ranks_nccl FAIL naming the backend" '[ "$(status two_ranks_nccl)" = FAIL ] && detail two_ranks_nccl | grep -q "choice=Nccl"'
finish nccl_230_staged_is_a_failure

FAKE_GPUS=2 FAKE_NCCL=22809 verify two_gpus_old_nccl_runs --only nccl,two_ranks_nccl --budget 0
expect "exit 0" '[ "$rc" = 0 ]'
expect "two_ranks_nccl PASS" '[ "$(status two_ranks_nccl)" = PASS ]'
expect "nccl PASS, no skipped case" '[ "$(status nccl)" = PASS ] && [ -z "$(status nccl/two_ranks_and_peer_loss)" ]'
finish two_gpus_old_nccl_runs

# ---------------------------------------------------------------------------------------------
# The real binary's honest skip, on the simulated driver (tests/fake): no kernels needed.
bin=${GPU_NCCL_BIN:-}
if [ -z "$bin" ] && [ -x .device/stage/tests/gpu_nccl ]; then bin=.device/stage/tests/gpu_nccl; fi
if [ -z "$bin" ]; then
    bin=$(find target/release/deps -maxdepth 1 -name 'gpu_nccl-*' -type f -perm -u+x -printf '%T@ %p\n' 2>/dev/null | sort -n | tail -1 | cut -d' ' -f2- || true)
fi
if [ -z "$bin" ] || ! command -v cc >/dev/null; then
    echo "skipped: gpu_nccl_skip_on_simulated_gpu (no gpu_nccl binary: cargo build --release --test gpu_nccl; or no cc)"
    skipped=$((skipped + 1))
else
    cc -shared -fPIC -O1 -o "$tmp/libcuda.so.1" tests/fake/sim_cuda.c
    cc -shared -fPIC -O1 -o "$tmp/libnccl.so.2" tests/fake/sim_nccl.c
    sim() { LOCKSTEP_CUDA_LIBRARY=$tmp/libcuda.so.1 LOCKSTEP_NCCL_LIBRARY=$tmp/libnccl.so.2 SIM_CUDA_DEVICES=1 SIM_NCCL_VERSION=22809 \
        LOCKSTEP_REQUIRE_GPU=1 timeout 60 "$@"; }
    name=gpu_nccl_skip_on_simulated_gpu
    rc=0; sim "$bin" two_ranks > "$tmp/$name.log" 2>&1 || rc=$?
    expect "exit 0" '[ "$rc" = 0 ]'
    expect "a skip line naming 2.28.9" 'grep -q "^test two_ranks_and_peer_loss \.\.\. skipped: .*2\.28\.9" "$tmp/$name.log"'
    expect "not counted as passed" 'grep -q "^0 passed, 1 skipped, 0 failed" "$tmp/$name.log" && ! grep -q "two_ranks_and_peer_loss \.\.\. ok" "$tmp/$name.log"'
    rc=0; LOCKSTEP_REQUIRE_NCCL_TWO_RANKS=1 sim "$bin" two_ranks >> "$tmp/$name.log" 2>&1 || rc=$?
    expect "LOCKSTEP_REQUIRE_NCCL_TWO_RANKS=1: exit 1" '[ "$rc" = 1 ] && grep -q "two_ranks_and_peer_loss \.\.\. FAILED" "$tmp/$name.log"'
    finish "$name"
fi

echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" = 0 ]
