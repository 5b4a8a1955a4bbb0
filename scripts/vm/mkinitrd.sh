#!/bin/bash
# Build a tiny busybox initramfs that loads virtio/9p/ext4 modules from the rootfs and switch_roots.
# (from ../shared/notes/softroce-vm, unchanged but for this line)
# usage: scripts/vm/mkinitrd.sh ROOTFS_DIR KVER OUT.gz
set -euo pipefail
ROOT=$1; KVER=$2; OUT=$3
W=$(mktemp -d); trap 'rm -rf $W' EXIT
mkdir -p $W/{bin,proc,sys,dev,newroot,lib/modules/$KVER}
cp /bin/busybox $W/bin/
MODS="$(chroot $ROOT modinfo -k $KVER virtio_pci >/dev/null 2>&1 && echo virtio_pci) virtio_blk virtio_net 9pnet_virtio 9p ext4 virtio_rng"
LIST=$(for m in $MODS; do chroot $ROOT modprobe -S $KVER --show-depends $m | awk '$1=="insmod"{print $2}'; done | awk '!s[$0]++')
: > $W/modlist
for f in $LIST; do b=$(basename $f); case $b in
  *.xz) xz -dc $ROOT$f > $W/lib/modules/$KVER/${b%.xz};  b=${b%.xz};;
  *.zst) zstd -qdc $ROOT$f > $W/lib/modules/$KVER/${b%.zst}; b=${b%.zst};;
  *) cp $ROOT$f $W/lib/modules/$KVER/;; esac
  echo /lib/modules/$KVER/$b >> $W/modlist; done
cat > $W/init <<'EOS'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for f in $(cat /modlist); do insmod $f 2>/dev/null; done
ROOT=/dev/vda; FST=ext4; INIT=/sbin/vminit; RO=rw
for a in $(cat /proc/cmdline); do case $a in root=*) ROOT=${a#root=};; rootfstype=*) FST=${a#rootfstype=};; init=*) INIT=${a#init=};; esac; done
if [ "$FST" = 9p ]; then
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=loose,rw $ROOT /newroot || { echo "9p root mount failed"; sh; }
else
  i=0; while [ ! -b $ROOT ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
  mount -t $FST -o rw $ROOT /newroot || { echo "root mount failed"; sh; }
fi
umount /proc /sys; mount --move /dev /newroot/dev 2>/dev/null || umount /dev
exec switch_root /newroot $INIT
EOS
chmod +x $W/init
(cd $W && find . | cpio -o -H newc 2>/dev/null | gzip -1) > $OUT
echo "initrd $OUT: $(du -h $OUT | cut -f1), $(wc -l < $W/modlist) modules"
