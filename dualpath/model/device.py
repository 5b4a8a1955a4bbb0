"""Where an engine computes: the host's CPU, or a GPU that torch sees.

On a GPU, "HBM" is real GPU memory: the model's weights, the past KV a pass attends to and
the decode batch's KV live there. NIXL still moves bytes between host buffers (the engine's
registered region is page-locked host memory, so the H2D and D2H copies are DMA), because
registering GPU memory with NIXL needs a CUDA build of UCX this project does not ship.
"""
from __future__ import annotations

import os

import numpy as np
import torch

DEVICES = ("cpu", "cuda")


class DeviceError(ValueError):
    """A device an engine cannot compute on here. The message is one line, with its fix."""


def resolve_device(name: str) -> torch.device:
    """`name` as a torch device, once checked usable here; raises DeviceError otherwise.

    On CUDA it also turns off the reduced-precision shortcuts (TF32, reduced-precision
    reductions) so that fp32 is fp32, and asks cuBLAS for its deterministic workspace: the
    testbed checks KV bit-exact against a recomputation on the same device.
    """
    if name not in DEVICES:
        raise DeviceError(f"{name[:40]!r} is not one of {', '.join(DEVICES)}; fix: choose cpu or cuda")
    if name == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise DeviceError(f"cuda: torch {torch.__version__} ({build}) sees no GPU here; fix: run on "
                              f"a machine with an NVIDIA GPU and a CUDA build of torch "
                              f"{torch.__version__.split('+')[0]}, or use --device cpu")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    return torch.device(name)


def host_buffer(nbytes: int, device: torch.device) -> np.ndarray:
    """An engine's registered host memory, zeroed: page-locked when it feeds a GPU, so that
    H2D and D2H copies from and to it are DMA; plain (pages appear as touched) on the CPU."""
    if device.type == "cuda":
        # the array's base keeps the pinned tensor (and its page-locked memory) alive
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return np.zeros(nbytes, dtype=np.uint8)


def to_device(kv: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (K, V) views of host memory on `device`: the H2D copy (none on the CPU,
    where the views are the memory the model reads)."""
    if device.type == "cpu":
        return kv
    return kv[0].to(device), kv[1].to(device)
