"""The paper's bottleneck-free P/D range (DualPath section 4.2).

With g GPUs per node, SNIC bandwidth s*B per node, CNIC bandwidth B per GPU
and DRAM bandwidth M per node, dual-path loading saturates every SNIC with no
CNIC or DRAM bottleneck when

    s/(g-s) <= P/D <= min((g-2s)/s, (g-s)/(2s), (M/(B*s) - 3)/2).

The Chinese article's erratum: the PE CNIC read-direction condition that the
paper states as s <= g is really s <= g/2; `pe_read_condition_holds` checks it.

`paper_model` writes the same derivation as resources for the generic method
(dualpath/analysis/method.py): a CNIC's PCIe reads and writes are separate
resources (the loopback H2D takes both), DRAM is one per node shared by reads
and writes. Counted per hit byte, from the article's section 3.2 (the numbers
are the steps of the paper's figure 4):
    PE CNIC read:  PE path 2 ((3) DRAM -> CNIC, (5) HBM -> CNIC), DE path 0
    PE CNIC write: PE path 1 ((4) into HBM),  DE path 1 ((5) into HBM)
    DE CNIC read:  PE path 1 ((8) H2D),       DE path 2 ((3) to the PE, (6) H2D)
    DE CNIC write: PE path 2 ((7) into DRAM, (9) into HBM), DE path 1 ((7) into HBM)
    PE DRAM:       PE path 2 (SNIC write, CNIC read)
    DE DRAM:       PE path 2 (write, read), DE path 3 (SNIC write, two CNIC reads)
`pd_bounds` (the closed form) and `pd_range(paper_model(...))` agree.
"""
from __future__ import annotations

import math

from dualpath.analysis.method import Model, Resource

PAPER_G, PAPER_S, PAPER_M_OVER_B = 8, 1.0, 10.0  # 8 GPUs, one 400G SNIC, 8 x 400G CNICs, 500 GB/s DRAM


def pd_bounds(g: float, s: float, m_over_b: float) -> tuple[float, float]:
    """(lower, upper) bound on P/D; upper may be below lower (no feasible ratio)."""
    if g <= s:
        return (math.inf, -math.inf)
    lower = s / (g - s)
    upper = min((g - 2 * s) / s, (g - s) / (2 * s), (m_over_b / s - 3) / 2)
    return (lower, upper)


def pe_read_condition_holds(g: float, s: float) -> bool:
    """PE CNIC read direction stays bottleneck-free (erratum: s <= g/2)."""
    return s <= g / 2


def paper_model(g: float, s: float, m_over_b: float) -> Model:
    """The paper's resources, rates in units of B (see the module docstring)."""
    return Model("paper", snic_rate=s, snic="SNIC", resources=(
        Resource("SNIC", "all", 1, s, 1, 1),
        Resource("PE CNIC read", "pe", g, 1, 2, 0),
        Resource("PE CNIC write", "pe", g, 1, 1, 1),
        Resource("DE CNIC read", "de", g, 1, 1, 2),
        Resource("DE CNIC write", "de", g, 1, 2, 1),
        Resource("PE DRAM", "pe", 1, m_over_b, 2, 0),
        Resource("DE DRAM", "de", 1, m_over_b, 2, 3),
    ))
