"""GPU specs of the emulated target: peak dense BF16 FLOP/s, HBM bandwidth and capacity.

Peaks are the vendor's datasheet numbers (NVIDIA H100/H800 SXM and H200 SXM, dense, no sparsity).
A real kernel reaches only part of a peak, so every spec carries one `efficiency` that scales BOTH
achieved FLOP/s and achieved HBM bandwidth. Its default, 0.6, is a stated assumption (a typical
model-FLOPs utilisation of tuned prefill kernels on Hopper), not a fit to any measurement of the
paper: the paper publishes no per-pass timings to fit against. One factor for both keeps the
model's compute-to-memory balance equal to the hardware's, so the choice moves every emulated
duration by the same factor and changes no ratio the experiments compare.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ._names import lookup

DEFAULT_EFFICIENCY = 0.6


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    bf16_flops: float  # peak dense BF16 tensor-core FLOP/s
    hbm_bytes_per_s: float  # peak HBM bandwidth, bytes/s
    hbm_bytes: float  # HBM capacity, bytes
    efficiency: float = DEFAULT_EFFICIENCY  # fraction of both peaks a kernel achieves (assumed)

    def __post_init__(self) -> None:
        for k in ("bf16_flops", "hbm_bytes_per_s", "hbm_bytes"):
            v = getattr(self, k)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"GPU {self.name}: {k} must be finite and > 0, got {v!r}")
        if not (0 < self.efficiency <= 1):
            raise ValueError(f"GPU {self.name}: efficiency must be in (0, 1], got {self.efficiency!r}")

    @property
    def achieved_flops(self) -> float:
        return self.bf16_flops * self.efficiency

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.efficiency

    def with_efficiency(self, efficiency: float) -> "GpuSpec":
        return replace(self, efficiency=efficiency)


# The paper's nodes are "8 NVIDIA Hopper GPUs" without saying which; the production cluster of
# DeepSeek is H800 (same SXM compute and HBM as H100, cut NVLink), so h800 is the default target.
GPUS: dict[str, GpuSpec] = {
    "h800": GpuSpec("h800", bf16_flops=989.4e12, hbm_bytes_per_s=3.35e12, hbm_bytes=80e9),
    "h100": GpuSpec("h100", bf16_flops=989.4e12, hbm_bytes_per_s=3.35e12, hbm_bytes=80e9),
    "h200": GpuSpec("h200", bf16_flops=989.4e12, hbm_bytes_per_s=4.8e12, hbm_bytes=141e9),
}


def gpu(name: str) -> GpuSpec:
    """The catalog entry `name`; an unknown name is a one-line error listing the valid ones."""
    return lookup(GPUS, "GPU", name)
