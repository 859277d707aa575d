# Shared by the project's Pi steps (sourced). pi_check.sh exports PI, R (its arm64 root), SRC, HOSTVENV, INCHROOT.
# NOGCC: an overlay of R with the compiler and the Python headers removed (R itself is left as it is).
set -uo pipefail
NOGCC=$PI/nogcc
log() { echo "[$(date +%T)] $*"; }

# run a command in the overlay root, in /root/work, with the wheel's venv (/root/fedsketch-wheel) on the PATH
in_nogcc() {
  chroot "$NOGCC/root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 QEMU_CPU=${QEMU_CPU:-${PI_CPU:-cortex-a72}} \
    ${EXTRA_ENV:-} PATH=/root/fedsketch-wheel/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash -c "cd /root/work && $*"
}

mount_nogcc() {  # the overlay, its /proc (with a Pi 4's cpuinfo, as pi_check.sh does), /dev and /sys
  # "fresh": start from R again (wheel.sh); otherwise what wheel.sh changed in the overlay is kept
  mountpoint -q "$NOGCC/root" && return 0
  [ "${1:-}" = fresh ] && rm -rf "$NOGCC"
  mkdir -p "$NOGCC/upper" "$NOGCC/work" "$NOGCC/root"
  mount -t overlay overlay -o "lowerdir=$R,upperdir=$NOGCC/upper,workdir=$NOGCC/work" "$NOGCC/root" || return 1
  mount -t proc proc "$NOGCC/root/proc"
  mount --bind "$PI/cpuinfo.pi4" "$NOGCC/root/proc/cpuinfo"
  mount --rbind /dev "$NOGCC/root/dev" && mount --make-rslave "$NOGCC/root/dev"
  mount --rbind /sys "$NOGCC/root/sys" && mount --make-rslave "$NOGCC/root/sys"
}

umount_nogcc() {
  umount "$NOGCC/root/proc/cpuinfo" 2>/dev/null; umount "$NOGCC/root/proc" 2>/dev/null
  umount -R "$NOGCC/root/dev" 2>/dev/null; umount -R "$NOGCC/root/sys" 2>/dev/null
  umount "$NOGCC/root" 2>/dev/null
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
