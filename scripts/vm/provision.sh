#!/bin/bash
# What the Soft-RoCE test VM holds, in one place: the Debian packages, the kernel, and the
# guest's own configuration. Two users, so that they cannot drift:
#   scripts/vm/build.sh   sources this file for the lists and runs `provision.sh configure`
#                         in the image's chroot (the QEMU image, built from Debian packages alone);
#   Vagrantfile           runs `provision.sh vagrant` inside a booted Debian 12 box: the same
#                         packages and kernel through apt, then the project's bootstrap.
#
#   provision.sh packages         print the guest's Debian packages, comma-separated
#   provision.sh configure        guest configuration (chroot or booted guest)
#   provision.sh vagrant [REPO]   everything, in a booted bookworm guest (root), then bootstrap
#
# Why this kernel: rdma_rxe must work inside a non-init network namespace (the testbed gives
# every engine and host namespace its own rxe device). It does on 7.x (trixie-backports), not
# on bookworm's 6.1 or trixie's 6.12: there the rxe UDP socket exists only in init_net and no
# packet flows (measured, ../shared/notes/softroce-vm). Its linux-base (>= 4.17) also comes
# from trixie-backports and depends on debconf alone, so it installs on bookworm.
set -euo pipefail

VM_SUITE=bookworm            # Python 3.11, the same as the host: a host-built venv runs unchanged
KERNEL_SUITE=trixie-backports
KERNEL_META=linux-image-amd64

# The testbed's own needs (mininet, tc, nftables, iperf3, fio, pyverbs; the python3-* that the
# venv, made with --system-site-packages on a host that has them, takes from Debian), RDMA (rdma-core for
# `rdma link`, the rxe provider, perftest for ib_read_bw/ib_write_bw), what a shell needs, and an
# sshd for the guest as a second server (make cluster-test; debootstrap keeps it from starting
# while it installs, and the guest starts it only when asked: scripts/vm/serve_ssh.sh).
VM_PACKAGES=(
    kmod iproute2 iputils-ping procps psmisc ethtool netbase ca-certificates less curl bc time
    strace make
    python3 python3-venv python3-pip
    python3-yaml python3-pyparsing python3-six python3-pygments python3-setuptools
    mininet bridge-utils iperf3 fio nftables iptables tcpdump
    rdma-core ibverbs-utils ibverbs-providers libibverbs1 perftest python3-pyverbs
    openssh-server
)

# Modules the testbed loads on demand anyway; listed so that a booted guest has them at once.
VM_MODULES=(rdma_rxe ib_uverbs veth bridge sch_htb sch_netem cls_u32 nf_tables ip_gre vxlan)

# The system libibverbs: NIXL's wheel bundles its own (rdma-core 48), which cannot load this
# system's rxe provider, so UCX silently falls back to TCP unless this one is preloaded
# (dualpath/transport/rdma.py checks, and the testbed preloads it for --transport rdma).
SYSTEM_LIBIBVERBS=/usr/lib/x86_64-linux-gnu/libibverbs.so.1

configure() {
    mkdir -p /etc/modules-load.d
    printf '%s\n' "${VM_MODULES[@]}" > /etc/modules-load.d/dpt-softroce.conf
    # iperf3's package asks whether to start a daemon; the testbed starts its own servers.
    echo "iperf3 iperf3/start_daemon boolean false" | debconf-set-selections 2>/dev/null || true
    echo "dpt-vm" > /etc/hostname
    test -e "$SYSTEM_LIBIBVERBS" || { echo "provision: $SYSTEM_LIBIBVERBS missing" >&2; exit 1; }
}

# The Debian mirror this machine uses (never a host name written here).
mirror() {
    local m=""
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        m=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    fi
    if [ -z "$m" ] && [ -f /etc/apt/sources.list ]; then
        m=$(awk '$1=="deb" && $2 !~ /security/ {print ($2 ~ /^\[/ ? $3 : $2); exit}' /etc/apt/sources.list)
    fi
    [ -n "$m" ] || { echo "provision: no Debian mirror in this machine's apt configuration" >&2; exit 1; }
    echo "$m"
}

vagrant() {
    local repo=${1:-/vagrant}
    export DEBIAN_FRONTEND=noninteractive
    . /etc/os-release
    [ "${VERSION_CODENAME:-}" = "$VM_SUITE" ] || echo "provision: warning: this guest is ${VERSION_CODENAME:-?}, not $VM_SUITE" >&2
    local m; m=$(mirror)
    echo "deb $m $KERNEL_SUITE main" > /etc/apt/sources.list.d/dpt-kernel.list
    # Backports stay opt-in (priority 100): only what is asked for with -t comes from there.
    apt-get update -qq
    echo "iperf3 iperf3/start_daemon boolean false" | debconf-set-selections
    apt-get install -y -qq --no-install-recommends "${VM_PACKAGES[@]}"
    apt-get install -y -qq --no-install-recommends -t "$KERNEL_SUITE" "$KERNEL_META" linux-base
    configure
    local k; k=$(dpkg-query -W -f='${Depends}' "$KERNEL_META" | grep -o 'linux-image-[0-9][^ ,]*' | head -1)
    echo "provision: kernel ${k#linux-image-} installed; reboot into it (vagrant reload) before --transport rdma"
    (cd "$repo" && bash scripts/bootstrap.sh)
}

case "${1:-}" in
    packages) (IFS=,; echo "${VM_PACKAGES[*]}") ;;
    modules) echo "${VM_MODULES[*]}" ;;
    configure) configure ;;
    mirror) mirror ;;
    vagrant) shift; vagrant "$@" ;;
    suite) echo "$VM_SUITE" ;;
    kernel-suite) echo "$KERNEL_SUITE $KERNEL_META" ;;
    *) echo "usage: $0 packages|modules|configure|mirror|suite|kernel-suite|vagrant [REPO]" >&2; exit 2 ;;
esac
