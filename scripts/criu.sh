#!/usr/bin/env bash
# CRIU >= 4.2 for the transparent mode (docs/transparent.md): built on this machine from Debian's source package of
# criu (the upstream tarball Debian ships in unstable, checked against its .dsc), installed as
# $TPASSRUN_CRIU_PREFIX/sbin/criu (default /opt/tpassrun-criu/sbin/criu), where tpassrun looks first.
#
#   bash scripts/criu.sh            install it unless a usable one (>= 4.2, `criu check` passes) is there
#   bash scripts/criu.sh --check    only say whether one is usable (exit 0) or why not (exit 1)
#
# Why built, not a Debian root: the workers must run on the host's own filesystem (the venv, the script, /tmp) and a
# chroot'ed criu restores paths inside its root. Debian 12's criu 3.17 cannot dump on kernels >= 6.x with the newer
# vDSO layout, 4.1 cannot dump a TCP socket on kernels >= 6.16; 4.2 can. Root only (criu needs it). Idempotent.
# Time on 2 shared cores: ~35 s of build dependencies + ~90 s of compiling (make -j2 criu, no docs, no crit).
set -euo pipefail
PREFIX=${TPASSRUN_CRIU_PREFIX:-/opt/tpassrun-criu}
BIN="$PREFIX/sbin/criu"
say() { echo "criu.sh: $*"; }

usable() {   # $1: a criu binary; prints why not when it is not usable
    local v
    v=$("$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -1) || true
    [ -n "$v" ] || { echo "$1 does not run"; return 1; }
    case "$v" in 0.*|1.*|2.*|3.*|4.0*|4.1*) echo "$1 is CRIU $v (< 4.2)"; return 1 ;; esac
    "$1" check >/dev/null 2>&1 || { echo "'$1 check' fails"; return 1; }
    return 0
}

if [ "${1:-}" = "--check" ]; then
    for c in "$BIN" "$(command -v criu || true)"; do
        [ -n "$c" ] && [ -x "$c" ] && usable "$c" >/dev/null && { say "usable: $c"; exit 0; }
    done
    say "no usable CRIU (>= 4.2 whose 'criu check' passes); bash scripts/criu.sh installs one"
    exit 1
fi
can_install() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
# the job's network lock while its TCP connections are dumped and restored is an nftables table (the nft command)
if ! command -v nft >/dev/null 2>&1 && can_install; then
    say "apt-get install nftables"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nftables >/dev/null 2>&1 || true
fi
if [ -x "$BIN" ] && usable "$BIN" >/dev/null; then
    say "ready: $BIN ($("$BIN" --version | sed -n 's/^Version: *//p'))"
    exit 0
fi
if ! can_install; then
    say "skipped: needs root and apt-get (transparent mode falls back to torchrun's restart without it)"
    exit 0
fi
started=$(date +%s)
DEPS="build-essential pkg-config libbsd-dev libcap-dev libnet1-dev libnftables-dev libnl-3-dev libprotobuf-c-dev \
libprotobuf-dev protobuf-c-compiler protobuf-compiler uuid-dev libgnutls28-dev xz-utils nftables"
say "apt-get install the build dependencies"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $DEPS >/dev/null 2>&1 \
    || { say "apt-get install of the build dependencies failed"; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Debian's source index of unstable, in a private apt state (the machine's own sources stay as they are)
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/src"
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main" \
    > "$WORK/sources.list"
APT=(-o Dir::Etc::SourceList="$WORK/sources.list" -o Dir::Etc::SourceParts=/dev/null -o Dir::State::Lists="$WORK/lists"
     -o Dir::Cache="$WORK/cache" -o Acquire::Check-Valid-Until=false -o APT::Sandbox::User=root)
say "apt-get source criu (Debian unstable)"
apt-get "${APT[@]}" update -qq
# only the upstream tarball is needed (the Debian patches are packaging); apt checks it against the signed .dsc
(cd "$WORK/src" && apt-get "${APT[@]}" source --download-only criu >/dev/null 2>&1) || true
DSC=$(ls "$WORK"/src/criu_*.dsc 2>/dev/null | head -1)
ORIG=$(ls "$WORK"/src/criu_*.orig.tar.* 2>/dev/null | head -1)
[ -n "$DSC" ] && [ -n "$ORIG" ] || { say "could not fetch criu's source package"; exit 1; }
want=$(awk '/^Checksums-Sha256:/{f=1;next} f&&/orig\.tar/{print $1; exit}' "$DSC")
got=$(sha256sum "$ORIG" | cut -d' ' -f1)
[ "$want" = "$got" ] || { say "checksum mismatch for $(basename "$ORIG")"; exit 1; }
tar -C "$WORK" -xf "$ORIG"
SRC=$(ls -d "$WORK"/criu-*/ | head -1)
say "building $(basename "$SRC") (make criu, about 90 s on 2 cores)"
make -C "$SRC" -j"$(nproc)" criu >"$WORK/build.log" 2>&1 || { tail -20 "$WORK/build.log"; say "build failed"; exit 1; }
install -D -m 0755 "$SRC/criu/criu" "$BIN"
why=$(usable "$BIN") || { say "built, but not usable here: $why"; exit 1; }
say "ready: $BIN ($("$BIN" --version | sed -n 's/^Version: *//p'), $(( $(date +%s) - started )) s)"
