"""One factor for every timeout that waits on the testbed's own work.

The defaults are sized for the project's 2-core host. In the Soft-RoCE VM (scripts/vm.sh sets
DPT_IN_VM) QEMU TCG emulates floating point in software: a 128-token prefill of the demo model
took 21 s of guest CPU there, against milliseconds here, so a timeout sized for the host fires
on work that is only slow (the VM's first e2e run failed its 512-token warm-up after 120 s).
DPT_TIMEOUT_SCALE sets the factor by hand.
"""
from __future__ import annotations

import os

VM_FACTOR = 20.0  # the guest's Python and NIC emulation run about 10x slower; its float math far more


def timeout_scale() -> float:
    """The factor this process's timeouts are multiplied by (1 on an ordinary host)."""
    text = os.environ.get("DPT_TIMEOUT_SCALE", "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"DPT_TIMEOUT_SCALE={text[:40]!r} is not a number") from None
        if not 0 < value <= 1000:
            raise ValueError(f"DPT_TIMEOUT_SCALE={value:g} is outside (0, 1000]")
        return value
    return VM_FACTOR if os.environ.get("DPT_IN_VM") else 1.0


def scaled(seconds: float) -> float:
    """`seconds` on this machine: a host-sized timeout times timeout_scale()."""
    return seconds * timeout_scale()
