#!/usr/bin/env bash
# Install lockstep's C library into a prefix, as `cargo cinstall --release --prefix PREFIX` (cargo-c)
# would:
#
#   PREFIX/lib/liblockstep.so.MAJOR.MINOR.PATCH   the release build, stripped (soname liblockstep.so.MAJOR)
#   PREFIX/lib/liblockstep.so.MAJOR               -> liblockstep.so.MAJOR.MINOR.PATCH (what programs load)
#   PREFIX/lib/liblockstep.so                     -> liblockstep.so.MAJOR (what -llockstep finds)
#   PREFIX/include/lockstep.h
#   PREFIX/lib/pkgconfig/lockstep.pc              prefix=PREFIX
#
# Usage: scripts/install-c.sh PREFIX
#
# It first runs `cargo build --release -p lockstep-capi` (the build `cargo test --release`
# makes, so nothing is rebuilt after the tests), then checks that the library's soname, the
# header's version macros and Cargo.toml's version agree before copying anything.
#
# Environment:
#   DESTDIR            stage the files under DESTDIR/PREFIX (packaging); lockstep.pc still names PREFIX
#   LIBDIR             library directory (default PREFIX/lib; e.g. PREFIX/lib/x86_64-linux-gnu)
#   LOCKSTEP_NO_BUILD  1: install the release library as already built, without running cargo
#   STRIP              the strip program (default strip)
set -euo pipefail

die() {
    echo "install-c.sh: $*" >&2
    exit 1
}

if [ $# -ne 1 ] || [ -z "$1" ]; then
    die "usage: scripts/install-c.sh PREFIX (e.g. /usr/local or \$HOME/.local)"
fi

destdir=${DESTDIR:-}
prefix=$1
case $prefix in
    /*) ;;
    *)
        [ -z "$destdir" ] || die "PREFIX must be an absolute path when DESTDIR is set (got $prefix)"
        mkdir -p "$prefix"
        prefix=$(cd "$prefix" && pwd)
        ;;
esac
[ "$prefix" = / ] || prefix=${prefix%/}
libdir=${LIBDIR:-${prefix%/}/lib}
includedir=${prefix%/}/include
# A relative PREFIX was resolved against the caller's directory above; the rest runs in the repository.
cd "$(dirname "$0")/.."

# The version: Cargo.toml's [package] version (its first `version =` line).
version=$(sed -n 's/^version = "\([^"]*\)"$/\1/p;T;q' Cargo.toml)
[[ $version =~ ^([0-9]+)\.([0-9]+)\.([0-9]+)$ ]] || die "Cargo.toml's version \"$version\" is not MAJOR.MINOR.PATCH"
major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]} patch=${BASH_REMATCH[3]}
soname=liblockstep.so.$major
real=liblockstep.so.$version

if [ "${LOCKSTEP_NO_BUILD:-0}" != 1 ]; then
    cargo build --release -p lockstep-capi
fi
target=${CARGO_TARGET_DIR:-$(cargo metadata --no-deps --format-version 1 | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')}
[ -n "$target" ] || die "could not find cargo's target directory (set CARGO_TARGET_DIR)"
built=$target/release/liblockstep.so
[ -f "$built" ] || die "$built is missing: build it with cargo build --release -p lockstep-capi"

# What is about to be installed must agree with itself.
got=$(readelf -d "$built" | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')
[ "$got" = "$soname" ] || die "$built has soname \"$got\", not $soname: rebuild it (cargo build --release), build.rs sets the soname"
exports=$(nm -D --defined-only "$built")
grep -q ' lockstepGetVersion$' <<<"$exports" ||
    die "$built exports no C ABI: rebuild it with cargo build --release -p lockstep-capi"
for part in MAJOR:"$major" MINOR:"$minor" PATCH:"$patch"; do
    grep -q "^#define LOCKSTEP_${part%%:*} ${part#*:}\$" crates/capi/include/lockstep.h ||
        die "crates/capi/include/lockstep.h does not define LOCKSTEP_${part%%:*} ${part#*:} (Cargo.toml's version is $version): regenerate it with LOCKSTEP_UPDATE_HEADER=1 cargo build --release"
done

mkdir -p "$destdir$libdir/pkgconfig" "$destdir$includedir"
# Each file is written beside its destination and renamed over it, so a program starting
# meanwhile sees the old file or the new one, never half of one.
tmp=$destdir$libdir/.$real.tmp.$$
trap 'rm -f "$tmp" "$destdir$includedir/.lockstep.h.tmp.$$" "$destdir$libdir/pkgconfig/.lockstep.pc.tmp.$$"' EXIT
cp "$built" "$tmp"
"${STRIP:-strip}" --strip-unneeded "$tmp"
chmod 0755 "$tmp"
mv -f "$tmp" "$destdir$libdir/$real"
ln -sfn "$real" "$destdir$libdir/$soname"
ln -sfn "$soname" "$destdir$libdir/liblockstep.so"

install -m 0644 crates/capi/include/lockstep.h "$destdir$includedir/.lockstep.h.tmp.$$"
mv -f "$destdir$includedir/.lockstep.h.tmp.$$" "$destdir$includedir/lockstep.h"

# pkg-config paths relative to ${prefix} where they lie under it, so the file can be relocated
# (the ${...} are pkg-config's variables, written literally).
# shellcheck disable=SC2016
case $libdir in
    "$prefix"/*) pc_libdir='${exec_prefix}'${libdir#"$prefix"} ;;
    *) pc_libdir=$libdir ;;
esac
# shellcheck disable=SC2016
pc_includedir='${prefix}'${includedir#"${prefix%/}"}
pc=$destdir$libdir/pkgconfig/.lockstep.pc.tmp.$$
cat >"$pc" <<EOF
prefix=$prefix
exec_prefix=\${prefix}
libdir=$pc_libdir
includedir=$pc_includedir

Name: lockstep
Description: Collective communication with an NCCL-shaped C ABI (shared memory on one host, NCCL on GPUs)
Version: $version
Libs: -L\${libdir} -llockstep
Cflags: -I\${includedir}
EOF
chmod 0644 "$pc"
mv -f "$pc" "$destdir$libdir/pkgconfig/lockstep.pc"

echo "installed lockstep $version into $destdir$prefix:"
echo "  $libdir/$real (+ $soname, liblockstep.so)"
echo "  $includedir/lockstep.h"
echo "  $libdir/pkgconfig/lockstep.pc"
echo "build with: PKG_CONFIG_PATH=$libdir/pkgconfig cc prog.c \$(pkg-config --cflags --libs lockstep)"
