#!/bin/bash
# The Soft-RoCE test VM: a Debian guest with kernel 7.x (rdma_rxe), booted under QEMU TCG.
#
#   scripts/vm.sh build [--force]        build the image and its venv (cached; scripts/vm/build.sh)
#   scripts/vm.sh run [OPTIONS] CMD...   boot, run CMD as root in this checkout, power off;
#                                        prints its output and exits with its exit code
#   scripts/vm.sh shell [OPTIONS]        boot to a root shell on the serial console
#
# OPTIONS: --timeout S (900), --mem MB (6144), --smp N (2), --tap IF (a second NIC on the host's
#          tap device IF, made by the caller; MTU 9000, MAC 52:54:00:64:70:02: make cluster-test)
#
# The checkout is shared read-write at its own path (9p); the VM's venv (build/vm/venv) is a
# read-only disk image of it mounted at the same path: CMD runs with that venv first on PATH. Each run gets a folder under
# build/vm/runs/<id>/ (cmd.sh, output.log, rc, console.log).
#
# Why TCG: this host's /dev/kvm is a paravirtual hypervisor (PVM) that cannot run a stock
# kernel. TCG runs guest CPU work 5-9x slower and takes both cores: give the VM the
# machine to itself.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/.." && pwd)
VMDIR=${DPT_VM_DIR:-$REPO/build/vm}; IMG=$VMDIR/image; VENV=$VMDIR/venv
die() { echo "vm: $*" >&2; exit 2; }

cmd=${1:-}; shift || true
TMO=900; MEM=6144; SMP=2; TAP=""
while [ $# -gt 0 ]; do case $1 in
  --timeout) TMO=$2; shift 2;; --mem) MEM=$2; shift 2;; --smp) SMP=$2; shift 2;; --tap) TAP=$2; shift 2;;
  --) shift; break;; *) break;; esac; done

case "$cmd" in
  build) exec bash "$HERE/vm/build.sh" "$@" ;;
  run) [ $# -gt 0 ] || die "run: no command given" ;;
  shell) ;;
  *) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
[ "$(id -u)" -eq 0 ] || die "must run as root"
for f in vmlinuz initrd.gz rootfs.img; do
  [ -f "$IMG/$f" ] || die "no image at $IMG ($f missing): run scripts/vm.sh build (or make vm-image)"; done
[ -x "$VENV/bin/python" ] && [ -f "$VMDIR/venv.img" ] || die "no venv at $VENV: run scripts/vm.sh build"
[ "$VENV/.bootstrap-stamp" -nt "$VMDIR/venv.img" ] && die "the venv changed since its image was made: run scripts/vm.sh build"
case "$REPO" in *[[:space:],:]*) die "the checkout's path ($REPO) must not contain spaces, commas or colons (9p shares)";; esac

RUN=""
if [ "$cmd" = run ]; then
  id=$(date +%Y%m%d-%H%M%S)-$$; RUN=$VMDIR/runs/$id; mkdir -p "$RUN"
  { echo "# written by scripts/vm.sh run"
    echo "cd $(printf %q "$REPO") || exit 125"
    echo "export PATH=$(printf %q "$VENV/bin"):\$PATH DPT_IN_VM=1 PYTHONDONTWRITEBYTECODE=1"
    printf '%q ' "$@"; echo; } > "$RUN/cmd.sh"
fi
# tsc=unstable: under TCG the guest's TSC drifts from the HPET, and when the clocksource watchdog
# notices at run time the kernel re-patches sched_clock's static key while the other vCPU runs it;
# QEMU's multi-threaded TCG then hit the patch's int3 and the guest panicked (s29, 42 s into the
# smoke: "Oops: int3" in sched_clock_cpu). Marked at boot, the switch happens before SMP starts.
APPEND="root=/dev/vda rootfstype=ext4 console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off tsc=unstable"
APPEND="$APPEND vm.shares=repo:$REPO vm.disks=vdb:$VENV${RUN:+ vm.run=$RUN}"
ARGS=(-accel tcg,thread=multi,tb-size=512 -cpu max -smp "$SMP" -m "$MEM" -no-reboot
      -kernel "$IMG/vmlinuz" -initrd "$IMG/initrd.gz" -append "$APPEND"
      -drive "file=$IMG/rootfs.img,format=raw,if=virtio,cache=unsafe"
      -drive "file=$VMDIR/venv.img,format=raw,if=virtio,readonly=on"
      -nic user,model=virtio-net-pci
      -virtfs "local,path=$REPO,mount_tag=repo,security_model=none,id=repo"
      -object rng-random,filename=/dev/urandom,id=rng0 -device virtio-rng-pci,rng=rng0)
if [ -n "$TAP" ]; then
  [ -d "/sys/class/net/$TAP" ] || die "--tap $TAP: no such interface (the caller makes it)"
  ARGS+=(-netdev "tap,id=tap0,ifname=$TAP,script=no,downscript=no"
         -device "virtio-net-pci,netdev=tap0,host_mtu=9000,mac=52:54:00:64:70:02")
fi
# A root file system is one guest's at a time.
exec 9>"$IMG/.lock"; flock -n 9 || die "another VM is using $IMG"
T0=$(date +%s.%N)
if [ "$cmd" = shell ]; then
  timeout --foreground -k 5 "$TMO" qemu-system-x86_64 "${ARGS[@]}" -nographic; exit $?
fi
timeout -k 5 "$TMO" qemu-system-x86_64 "${ARGS[@]}" -display none -monitor none -serial stdio < /dev/null 2>&1 | tee "$RUN/console.log"
q=${PIPESTATUS[0]}
wall=$(echo "$(date +%s.%N) - $T0" | bc)
if [ -f "$RUN/rc" ]; then rc=$(cat "$RUN/rc"); else
  if [ "$q" = 124 ]; then echo "vm: timed out after ${TMO}s (--timeout)" >&2; rc=124
  else echo "vm: the VM ended (qemu exit $q) without the command's exit status" >&2; rc=125; fi
fi
printf 'vm: %s exited %s after %.1fs (boot + command + poweroff); log %s\n' "$1" "$rc" "$wall" "$RUN/output.log" >&2
exit "$rc"
