#!/usr/bin/env bash
# The C library as people install and link it: build the release library, install it into a
# temporary prefix with scripts/install-c.sh, check the installed files (soname, exported symbols,
# stripped, symlinks, pkg-config), build examples/c/hello.c with nothing but
# `pkg-config --cflags --libs lockstep`, and run it as 3 ranks under `lockstep launch` against the
# installed library. Needs cc, c++, pkg-config, readelf, nm and strip (binutils).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
    echo "c-install: $*" >&2
    exit 1
}

# The library and the launcher, with the default features (the build `cargo test --release`
# makes: nothing is rebuilt).
cargo build --release

work=$(mktemp -d "${TMPDIR:-/tmp}/lockstep-c-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
LOCKSTEP_NO_BUILD=1 scripts/install-c.sh "$prefix"

version=$(sed -n 's/^version = "\([^"]*\)"$/\1/p;T;q' Cargo.toml)
major=${version%%.*}
lib=$prefix/lib/liblockstep.so.$version

# Files and links.
if [ ! -f "$lib" ] || [ -L "$lib" ]; then fail "$lib is missing (or a link)"; fi
[ "$(readlink "$prefix/lib/liblockstep.so.$major")" = "liblockstep.so.$version" ] || fail "liblockstep.so.$major does not link to liblockstep.so.$version"
[ "$(readlink "$prefix/lib/liblockstep.so")" = "liblockstep.so.$major" ] || fail "liblockstep.so does not link to liblockstep.so.$major"
cmp -s crates/capi/include/lockstep.h "$prefix/include/lockstep.h" || fail "the installed lockstep.h differs from crates/capi/include/lockstep.h"

# The soname, and nothing but the C ABI exported: exactly the functions the header declares.
# (Outputs are captured before grep -q reads them: with pipefail, a grep that stops early would
# fail the pipe.)
dynamic=$(readelf -d "$lib")
grep -q "(SONAME) *Library soname: \[liblockstep.so.$major\]" <<<"$dynamic" || {
    echo "$dynamic" >&2
    fail "$lib lacks the soname liblockstep.so.$major"
}
exported=$(nm -D --defined-only "$lib" | awk '{ print $NF }' | sed 's/@.*//' | sort -u)
others=$(grep -v '^lockstep' <<<"$exported" || true)
[ -z "$others" ] || fail "$lib exports symbols outside lockstep*: $(tr '\n' ' ' <<<"$others")"
declared=$(grep -o '\blockstep[A-Za-z0-9_]*(' crates/capi/include/lockstep.h | tr -d '(' | sort -u)
[ "$exported" = "$declared" ] || {
    diff <(echo "$declared") <(echo "$exported") >&2 || true
    fail "the exported symbols (right) differ from the functions lockstep.h declares (left)"
}
echo "c-install: $lib: soname liblockstep.so.$major, exports the $(wc -l <<<"$exported") functions of lockstep.h and nothing else"

# Stripped: no static symbol table, no debug information.
sections=$(readelf -S -W "$lib")
if grep -qE ' \.(symtab|debug_[a-z_]+) ' <<<"$sections"; then
    grep -E ' \.(symtab|debug_)' <<<"$sections" >&2
    fail "$lib is not stripped"
fi

# pkg-config alone gives the flags.
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
[ "$(pkg-config --modversion lockstep)" = "$version" ] || fail "pkg-config --modversion lockstep is not $version"
[ "$(pkg-config --variable=prefix lockstep)" = "$prefix" ] || fail "lockstep.pc's prefix is not $prefix"
flags=$(pkg-config --cflags --libs lockstep)
echo "c-install: pkg-config --cflags --libs lockstep: $flags"
# shellcheck disable=SC2086 # the flags are words
cc -std=c11 -Wall -Wextra -Werror -pedantic examples/c/hello.c $flags -o "$work/hello"
# The header in C++ too, with the config initializer and the type aliases.
cflags=$(pkg-config --cflags lockstep)
# shellcheck disable=SC2086 # the flags are words
c++ -std=c++11 -Wall -Wextra -Werror -pedantic -fsyntax-only -x c++ - $cflags <<'EOF'
#include <lockstep.h>
int f(lockstepComm_t comm) {
    lockstepConfig_t config = LOCKSTEP_CONFIG_INITIALIZER;
    config.commName = "c++";
    float x = 1;
    return lockstepAllReduce(&x, &x, 1, lockstepFloat, lockstepSum, comm, NULL) == lockstepSuccess && config.size == sizeof config;
}
EOF
needed=$(readelf -d "$work/hello")
grep -q "(NEEDED) *Shared library: \[liblockstep.so.$major\]" <<<"$needed" || fail "hello does not record liblockstep.so.$major"

# Run against the installed library: 3 ranks under the launcher, each checks its all-reduce.
export LD_LIBRARY_PATH=$prefix/lib
loads=$(ldd "$work/hello")
grep -q "liblockstep.so.$major => $prefix/lib/liblockstep.so.$major " <<<"$loads" ||
    fail "hello does not load the installed library: $(grep lockstep <<<"$loads")"
out=$(timeout -k 5 120 target/release/lockstep launch --nproc-per-node 3 -- "$work/hello") || {
    echo "$out" >&2
    fail "hello failed under lockstep launch --nproc-per-node 3"
}
echo "$out"
for r in 0 1 2; do
    grep -q "^\[rank $r\] rank $r of 3: hello from lockstep $version, all-reduce sum 6 (checked)" <<<"$out" || fail "rank $r did not report"
done
echo "c-install: installed, linked with pkg-config and ran as 3 ranks"
