#!/usr/bin/env bash
# The test suite: `cargo test --release` (arguments are passed on), then one line adding up every
# test binary's summary, skips included: the runner's `N passed, M skipped, F failed` lines
# (tests/common/runner.rs) and libtest's `test result: ... N passed; F failed; I ignored` lines
# (unit tests, doc tests; an ignored test counts as skipped). The exit status is cargo's.
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --release "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
awk '
    /^[0-9]+ passed, [0-9]+ skipped, [0-9]+ failed/ {
        p += $1; s += $3; f += $5; n++
    }
    /^test result: (ok|FAILED)\. [0-9]+ passed; [0-9]+ failed; [0-9]+ ignored/ {
        sub(/;/, "", $4); sub(/;/, "", $6); sub(/;/, "", $8)
        p += $4; f += $6; s += $8; n++
    }
    / \.\.\. skipped: / { skipped[++k] = $0 }
    END {
        print ""
        if (k > 0) {
            print "skipped tests:"
            for (i = 1; i <= k; i++) print "  " skipped[i]
        }
        printf "all test binaries (%d summaries): %d passed, %d skipped, %d failed\n", n, p, s, f
    }
' "$log"
exit "$status"
