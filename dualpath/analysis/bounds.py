"""The paper's bottleneck-free P/D range (DualPath section 4.2).

With g GPUs per node, SNIC bandwidth s*B per node, CNIC bandwidth B per GPU
and DRAM bandwidth M per node, dual-path loading saturates every SNIC with no
CNIC or DRAM bottleneck when

    s/(g-s) <= P/D <= min((g-2s)/s, (g-s)/(2s), (M/(B*s) - 3)/2).

The Chinese article's erratum: the PE CNIC read-direction condition that the
paper states as s <= g is really s <= g/2; `pe_read_condition_holds` checks it.
"""
from __future__ import annotations

import math


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
