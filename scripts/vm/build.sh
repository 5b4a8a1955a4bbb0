#!/bin/bash
# Build the Soft-RoCE test VM from Debian packages alone, and the venv it runs the testbed with.
#   root file system: Debian 12 (bookworm) by debootstrap, packages from scripts/vm/provision.sh
#   kernel:           the newest linux-image-amd64 of trixie-backports (7.x: rxe works in a
#                     non-init network namespace), unpacked with dpkg -x (no initramfs-tools
#                     needed: a busybox initramfs, scripts/vm/mkinitrd.sh)
#   venv:             build/vm/venv, made here with Debian's /usr/bin/python3 (3.11, the same as
#                     the guest's) by scripts/bootstrap.sh; the guest mounts it, from an ext4
#                     image of it (build/vm/venv.img), read-only at the same path
# usage: scripts/vm/build.sh [--force]        (as root; about 1.5 min, 1.5 GB under build/vm)
# Cached and idempotent: a second run checks a stamp (a hash of the scripts that make the
# image) and returns. The Debian mirror comes from this machine's own apt configuration.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
VMDIR=${DPT_VM_DIR:-$REPO/build/vm}; IMG=$VMDIR/image
FORCE=0; [ "${1:-}" = --force ] && FORCE=1
[ "$(id -u)" -eq 0 ] || { echo "vm build: must run as root (debootstrap, chroot)" >&2; exit 1; }
T0=$(date +%s); t() { echo "[vm build +$(( $(date +%s)-T0 ))s] $*"; }
PROV=$HERE/provision.sh

# -- the venv (bootstrap is itself idempotent) ----------------------------------------------
t "venv $VMDIR/venv (scripts/bootstrap.sh)"
mkdir -p "$VMDIR"
(cd "$REPO" && DPT_VENV="$VMDIR/venv" bash scripts/bootstrap.sh)
# The guest mounts the venv from a disk image at the same path: over 9p, `import torch` took
# 74 s in the guest (thousands of small reads, each a round trip to QEMU).
if [ ! -f "$VMDIR/venv.img" ] || [ "$VMDIR/venv/.bootstrap-stamp" -nt "$VMDIR/venv.img" ] || [ $FORCE = 1 ]; then
  t "venv image $VMDIR/venv.img"
  mb=$(du -sm "$VMDIR/venv" | cut -f1)
  rm -f "$VMDIR/venv.img.tmp"; truncate -s $(( mb * 13 / 10 + 256 ))M "$VMDIR/venv.img.tmp"
  mkfs.ext4 -q -F -L dptvenv -d "$VMDIR/venv" "$VMDIR/venv.img.tmp" && mv "$VMDIR/venv.img.tmp" "$VMDIR/venv.img"
fi

# -- the image ------------------------------------------------------------------------------
want=$(cat "$HERE/build.sh" "$PROV" "$HERE/mkinitrd.sh" "$HERE/vminit" | sha256sum | cut -d' ' -f1)
if [ $FORCE = 0 ] && [ -f "$IMG/stamp" ] && [ "$(cat "$IMG/stamp")" = "$want" ] \
   && [ -f "$IMG/rootfs.img" ] && [ -f "$IMG/vmlinuz" ] && [ -f "$IMG/initrd.gz" ]; then
  t "image cached: $IMG (kernel $(cat "$IMG/kver")); --force rebuilds"
  exit 0
fi
need=(qemu-system-x86 qemu-utils debootstrap busybox-static cpio xz-utils zstd e2fsprogs)
dpkg -s "${need[@]}" >/dev/null 2>&1 || {
  t "host packages: ${need[*]}"
  apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
MIRROR=$(bash "$PROV" mirror)
read -r KSUITE KMETA <<< "$(bash "$PROV" kernel-suite)"
W=$VMDIR/work; rm -rf "$W"; mkdir -p "$W" "$IMG"
A=$VMDIR/apt; mkdir -p "$A/lists/partial" "$A/cache/archives/partial"
t "kernel: $KMETA from $KSUITE (private apt state under $A)"
echo "deb $MIRROR $KSUITE main" > "$A/sources.list"
AO=(-o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache" -o "Dir::Etc::SourceList=$A/sources.list"
    -o Dir::Etc::SourceParts=/nonexistent -o APT::Sandbox::User=root)
apt-get "${AO[@]}" update -qq
KPKG=$(apt-cache "${AO[@]}" depends "$KMETA" | awk '/Depends: linux-image-[0-9]/ && !x {print $2; x=1}')
KVER=${KPKG#linux-image-}
[ -n "$KVER" ] || { echo "vm build: no $KMETA in $KSUITE" >&2; exit 1; }
mkdir -p "$W/kdeb"
(cd "$W/kdeb" && apt-get "${AO[@]}" download -qq $(for p in linux-image linux-binary linux-base linux-modules; do
   apt-cache "${AO[@]}" show "$p-$KVER" >/dev/null 2>&1 && echo "$p-$KVER"; done))
for f in "$W"/kdeb/*.deb; do dpkg -x "$f" "$W/kroot"; done
MODDIR=$W/kroot/usr/lib/modules/$KVER; [ -d "$MODDIR" ] || MODDIR=$W/kroot/lib/modules/$KVER
cp "$MODDIR/vmlinuz" "$W/vmlinuz" 2>/dev/null || cp "$W/kroot/boot/vmlinuz-$KVER" "$W/vmlinuz"
t "kernel $KVER"

SUITE=$(bash "$PROV" suite)
t "debootstrap $SUITE (log: $W/debootstrap.log)"
R=$W/rootfs
debootstrap --variant=minbase --include="$(bash "$PROV" packages)" "$SUITE" "$R" "$MIRROR" \
  > "$W/debootstrap.log" 2>&1 || { tail -20 "$W/debootstrap.log"; exit 1; }

t "modules (pruned to what a VM without hardware needs), configuration, init, CA bundle"
mkdir -p "$R/usr/lib/modules"; cp -a "$MODDIR" "$R/usr/lib/modules/"
(cd "$R/usr/lib/modules/$KVER" && rm -f vmlinuz && cd kernel && rm -rf sound drivers/gpu drivers/media \
   drivers/net/wireless drivers/net/ethernet drivers/staging drivers/iio drivers/usb drivers/bluetooth \
   drivers/infiniband/hw drivers/hwmon drivers/hid)
chroot "$R" depmod "$KVER"
install -m755 "$PROV" "$R/usr/local/sbin/dpt-provision"
chroot "$R" /usr/local/sbin/dpt-provision configure
install -m755 "$HERE/vminit" "$R/sbin/vminit"
install -D -m755 /bin/busybox "$R/usr/local/bin/busybox"
# pip inside the guest (if ever used) must trust what this machine trusts
cp /etc/ssl/certs/ca-certificates.crt "$R/etc/ssl/certs/ca-certificates.crt"
rm -rf "$R"/var/cache/apt/archives/*.deb "$R"/var/lib/apt/lists/*_Packages
t "initramfs"
bash "$HERE/mkinitrd.sh" "$R" "$KVER" "$W/initrd.gz"
t "ext4 image"
truncate -s 6G "$W/rootfs.img"; mkfs.ext4 -q -F -L vmroot -d "$R" "$W/rootfs.img"
mv "$W/vmlinuz" "$W/initrd.gz" "$W/rootfs.img" "$IMG/"; echo "$KVER" > "$IMG/kver"
du -sh --apparent-size "$R" | cut -f1 > "$IMG/rootfs-size"
rm -rf "$W"
echo "$want" > "$IMG/stamp"
t "done: $IMG/{vmlinuz,initrd.gz,rootfs.img}, kernel $KVER, rootfs $(cat "$IMG/rootfs-size"), image $(du -h "$IMG/rootfs.img" | cut -f1) used"
