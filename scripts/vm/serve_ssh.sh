#!/bin/bash
# Inside the guest (scripts/vm.sh run --tap IF ... bash scripts/vm/serve_ssh.sh DIR CIDR): serve SSH
# on the tap NIC as a second server of a topology (make cluster-test), until /run/dpt-guest-stop
# (made over SSH) or DIR/stop appears.
#   DIR   a folder of the shared checkout: DIR/id.pub is the key root logs in with; the guest
#         writes DIR/ready once sshd listens, and DIR/host_key.pub (its host key, for known_hosts)
#   CIDR  the guest's address on the tap NIC, e.g. 10.79.0.2/24
# Bounded: scripts/vm.sh's --timeout powers the guest off whatever happens here.
set -euo pipefail
DIR=$1; CIDR=$2
nic=$(grep -l '^52:54:00:64:70:02$' /sys/class/net/*/address | head -1 | xargs dirname | xargs basename)
[ -n "$nic" ] || { echo "serve_ssh: no tap NIC (MAC 52:54:00:64:70:02)" >&2; exit 1; }
ip link set "$nic" mtu 9000 up
ip addr add "$CIDR" dev "$nic"
mkdir -p /root/.ssh /run/sshd; chmod 700 /root/.ssh
install -m 600 "$DIR/id.pub" /root/.ssh/authorized_keys
ssh-keygen -A >/dev/null
/usr/sbin/sshd -o ListenAddress="${CIDR%/*}" -o PermitRootLogin=prohibit-password \
  -o PasswordAuthentication=no -o UseDNS=no -o MaxStartups=50 -o MaxSessions=50
cp /etc/ssh/ssh_host_ed25519_key.pub "$DIR/host_key.pub"
echo "serve_ssh: sshd on $CIDR ($nic, mtu 9000), kernel $(uname -r)"
touch "$DIR/ready"
while [ ! -e /run/dpt-guest-stop ] && [ ! -e "$DIR/stop" ]; do sleep 1; done
echo "serve_ssh: stop asked"
