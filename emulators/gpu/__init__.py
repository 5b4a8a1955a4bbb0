"""The emulated GPU: a target GPU spec and target model config turned into the time coefficients
the engines and the scheduler use (dualpath.scheduler.cost_model), plus the paper's Table 1.

Pure logic: no I/O. `dualpath/` never imports this package; this package produces the coefficient
objects `dualpath/` consumes. See DESIGN.md section 3a.
"""
from .cost import TARGETS, Target, dilation, target
from .models import MODELS, TargetModel, model
from .specs import GPUS, GpuSpec, gpu
from .table1 import table1_rows

__all__ = ["GPUS", "GpuSpec", "gpu", "MODELS", "TargetModel", "model", "TARGETS", "Target", "target",
           "dilation", "table1_rows"]
