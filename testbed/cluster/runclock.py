"""A run's time base: the target GPU and the dilation, or the host's own time (DESIGN.md 3a).

On an emulated clock the engines hold every pass and decode step for the target's duration
times the dilation k (emulators/gpu/cost.py: dilation), so one emulated second lasts k
testbed seconds. Reports give emulated seconds, testbed seconds beside them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from dualpath.kv.layouts import BlockGeometry
from dualpath.model.config import load_config
from dualpath.scheduler.cost_model import AttentionCostModel, DecodeCostModel
from dualpath.scheduler.hbm import HbmPlan
from testbed.topology import Topology

# Tokens per Full Block in runs. Every Layer Block is one descriptor of a READ, and the
# transport's request frame for it travels the other way: with 16 tokens (4 KiB Layer Blocks
# of the demo model) that was 1.5-2 % of a NIC's bytes, with 32 it halves. The hit rate of the
# demo workload stays at 0.94 (0.95 with 16): the paper's 64 would cost more of it here.
RUN_BLOCK_TOKENS = 32


def run_geometry(checkpoint: Path, block_size: int = RUN_BLOCK_TOKENS) -> BlockGeometry:
    """The KV block geometry a run uses for this checkpoint."""
    return BlockGeometry.from_config(load_config(checkpoint), block_size=block_size)


@dataclass(frozen=True)
class RunClock:
    emulated: bool
    dilation: float  # testbed seconds per emulated second (1 on the host's clock)
    target: str  # "qwen2.5-32b on h800"
    kv_bytes_per_token: tuple[int, int]  # (testbed model, target model)
    prefill_cost: AttentionCostModel | None = None  # the target's, in emulated seconds
    decode_cost: DecodeCostModel | None = None
    prefill_tokens_per_s: float | None = None  # the target's, per emulated second (beta)
    # the group's per-layer AllToAll (topology `collectives: on`): the target's CNIC traffic and
    # the testbed's (dispatch, combine) bytes per token per testbed layer, scaled like KV
    collective: dict | None = None
    collective_per_token: tuple[float, float] | None = None
    hbm: HbmPlan | None = None  # the target's HBM per engine, in target bytes (emulated runs only)

    @classmethod
    def of(cls, topo: Topology, geom: BlockGeometry) -> "RunClock":
        tb = geom.kv_bytes_per_token
        tgt = topo.target()
        name = f"{topo.spec.target.model} on {topo.spec.target.gpu}"
        coll = {}
        if topo.spec.collectives:  # the topology checked that the target has one
            from emulators.gpu.collectives import collective_traffic

            traffic = collective_traffic(tgt.model)
            coll = {"collective": traffic.to_dict(),
                    "collective_per_token": traffic.per_testbed_layer(tb, tgt.model.kv_bytes_per_token, geom.n_layer)}
        if not topo.emulated:
            return cls(False, 1.0, name, (tb, tgt.model.kv_bytes_per_token), **coll)
        return cls(True, topo.dilation(tb), name, (tb, tgt.model.kv_bytes_per_token),
                   tgt.prefill_cost(), tgt.decode_cost(), tgt.prefill_tokens_per_s(0), **coll,
                   hbm=topo.hbm_plan(tb))

    def engine_timing(self) -> dict | None:
        """What the engines need to keep the target's time (None: the host's)."""
        if not self.emulated:
            return None
        return {"dilation": self.dilation, "prefill": self.prefill_cost.to_dict(),
                "decode": self.decode_cost.to_dict(),
                "hbm": asdict(self.hbm.decode)}

    def engine_collectives(self) -> dict | None:
        """What every engine's collective needs besides its peers (None: no collectives)."""
        if self.collective_per_token is None:
            return None
        d, c = self.collective_per_token
        return {"dispatch_per_token": d, "combine_per_token": c}

    def to_emulated(self, testbed_s: float) -> float:
        return testbed_s / self.dilation

    def to_dict(self) -> dict:
        return {"compute": "emulated" if self.emulated else "cpu", "target": self.target,
                "dilation": round(self.dilation, 6),
                "kv_bytes_per_token": {"testbed": self.kv_bytes_per_token[0], "target": self.kv_bytes_per_token[1]},
                "emulated_second_in_testbed_s": round(self.dilation, 6),
                "collectives": ({**self.collective, "testbed_dispatch_bytes_per_token_layer": round(self.collective_per_token[0], 1),
                                 "testbed_combine_bytes_per_token_layer": round(self.collective_per_token[1], 1)}
                                if self.collective else None),
                "hbm": self.hbm.to_dict() if self.hbm else None}
