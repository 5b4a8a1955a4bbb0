#!/bin/bash
# Build the Debian layer of the node image for `hosts: docker` from Debian packages alone, and
# load it into the testbed's own Docker daemon (testbed/fabric/containers.py starts that daemon;
# testbed/fabric/node_image.py runs this script, then adds the venv and the checkout as layers of their own).
#   root file system: Debian 12 (bookworm, Python 3.11: the host venv's interpreter) by
#                     debootstrap --variant=minbase, plus the packages below
# usage: scripts/docker/build-image.sh DOCKER_SOCKET [--force]        (as root)
# Cached and idempotent: the image's tag is a hash of this script; it is built only if the
# daemon lacks that tag. Pinned: the suite is fixed, and the image's package versions are written
# to build/docker/manifest-<tag>.txt. The Debian mirror comes from this machine's apt configuration.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
SOCK=${1:?usage: $0 DOCKER_SOCKET [--force]}; FORCE=0; [ "${2:-}" = --force ] && FORCE=1
[ "$(id -u)" -eq 0 ] || { echo "docker image: must run as root (debootstrap)" >&2; exit 1; }
SUITE=bookworm
# python3: the interpreter the venv points at (/usr/bin/python3); net-tools: the
# ifconfig with which Mininet brings up the interfaces it moved in (its shell runs inside); the
# rest is what a node process and a person debugging one need (ip, ps, ping).
PACKAGES=python3,libstdc++6,net-tools,iproute2,procps,iputils-ping
NAME=dpt-node
TAG=$(sha256sum "$HERE/build-image.sh" | cut -c1-12)
D=(docker -H "unix://$SOCK")
T0=$(date +%s); t() { echo "[docker image +$(( $(date +%s)-T0 ))s] $*"; }
if [ $FORCE = 0 ] && "${D[@]}" image inspect "$NAME:$TAG" >/dev/null 2>&1; then
  t "cached: $NAME:$TAG"; echo "image $NAME:$TAG"; exit 0
fi
OUT=$REPO/build/docker; mkdir -p "$OUT"
TAR=$OUT/rootfs-$TAG.tar
if [ $FORCE = 1 ] || [ ! -s "$TAR" ]; then
  command -v debootstrap >/dev/null || { echo "docker image: debootstrap missing (apt-get install debootstrap)" >&2; exit 1; }
  MIRROR=$(bash "$REPO/scripts/vm/provision.sh" mirror)
  W=$(mktemp -d "$OUT/dpt-rootfs.XXXXXX"); trap 'rm -rf "$W"' EXIT
  t "debootstrap $SUITE (log: $OUT/debootstrap.log)"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$W/r" "$MIRROR" > "$OUT/debootstrap.log" 2>&1 \
    || { tail -20 "$OUT/debootstrap.log" >&2; exit 1; }
  chroot "$W/r" dpkg-query -W -f '${Package} ${Version}\n' > "$OUT/manifest-$TAG.txt"
  # Leave out what no node reads (under vfs, each container copies the image whole).
  rm -rf "$W/r/var/cache/apt/archives/"*.deb "$W/r/var/lib/apt/lists/"* "$W/r/usr/share/doc" \
         "$W/r/usr/share/man" "$W/r/usr/share/locale" "$W/r/usr/share/info"
  tar -C "$W/r" --numeric-owner -cf "$TAR.tmp" . && mv "$TAR.tmp" "$TAR"
fi
t "import $NAME:$TAG ($(du -m "$TAR" | cut -f1) MB)"
"${D[@]}" import --change 'CMD ["sleep", "infinity"]' "$TAR" "$NAME:$TAG" >/dev/null
# Earlier builds (another version of this script) are nobody's: drop them, image and tarball.
for old in $("${D[@]}" images --format '{{.Repository}}:{{.Tag}}' "$NAME" | grep -v ":$TAG\$" || true); do
  "${D[@]}" rmi "$old" >/dev/null || true
done
find "$OUT" -maxdepth 1 -name 'rootfs-*.tar' ! -name "rootfs-$TAG.tar" -delete
t "built $NAME:$TAG"
echo "image $NAME:$TAG"
