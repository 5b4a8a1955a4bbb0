"""Prefill attention-time model: predicts a forward pass from its (cached, new) pairs.

A request with `cached` tokens already in KV and `new` tokens to compute costs
    per_new * new                          (projections, KV population)
  + per_pair * (new*cached + new(new+1)/2) (causal attention: new token i sees cached + i keys)
  + per_cached * cached                    (streaming the cached KV through the kernel)
and a batch adds one `intercept` (launch overhead). Coefficients are fitted by non-negative least
squares on profiling samples taken on the real engine; keeping them >= 0 keeps the time monotone in
`new`, which the chunking binary search relies on.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from itertools import combinations

import numpy as np


def attention_pairs(cached: int, new: int) -> int:
    """(query, key) pairs of causal attention for `new` tokens after `cached` ones."""
    return new * cached + new * (new + 1) // 2


@dataclass(frozen=True, slots=True)
class ProfileSample:
    """One measured forward pass: its requests as (cached, new) and the attention seconds."""

    batch: tuple[tuple[int, int], ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class AttentionCostModel:
    intercept: float = 0.0
    per_new: float = 0.0
    per_pair: float = 0.0
    per_cached: float = 0.0

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not (v >= 0 and np.isfinite(v)):
                raise ValueError(f"cost model {k} must be finite and >= 0, got {v!r}")

    def request_cost(self, cached: int, new: int) -> float:
        """Seconds one request adds to a batch; 0 when it computes nothing."""
        if new <= 0:
            return 0.0
        return self.per_new * new + self.per_pair * attention_pairs(cached, new) + self.per_cached * cached

    def predict(self, batch: Iterable[tuple[int, int]]) -> float:
        """Predicted attention seconds of one forward pass. Sums in batch order, exactly as
        batching.pack_batch does, so both agree to the last bit."""
        t = self.intercept
        for cached, new in batch:
            t += self.request_cost(cached, new)
        return t

    @staticmethod
    def features(batch: Iterable[tuple[int, int]]) -> list[float]:
        f = [1.0, 0.0, 0.0, 0.0]
        for cached, new in batch:
            if new <= 0:
                continue
            f[1] += new
            f[2] += attention_pairs(cached, new)
            f[3] += cached
        return f

    @classmethod
    def fit(cls, samples: Sequence[ProfileSample]) -> "AttentionCostModel":
        """Non-negative least squares on the samples.

        With four coefficients, exact NNLS is cheap by enumeration: solve ordinary least squares on
        every subset of features and keep the best solution whose coefficients are all >= 0.
        Columns are scaled first because pair counts dwarf the intercept column.
        """
        if not samples:
            raise ValueError("fit needs at least one profiling sample")
        X = np.array([cls.features(s.batch) for s in samples], dtype=float)
        y = np.array([s.seconds for s in samples], dtype=float)
        if not np.all(np.isfinite(y)) or np.any(y < 0):
            raise ValueError("sample seconds must be finite and >= 0")
        scale = np.abs(X).max(axis=0)
        scale[scale == 0] = 1.0
        Xs = X / scale
        best = np.zeros(4)
        best_sse = float(y @ y)
        for k in range(1, 5):
            for cols in combinations(range(4), k):
                sub = Xs[:, cols]
                coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
                if np.any(coef < 0):
                    continue
                r = y - sub @ coef
                sse = float(r @ r)
                if sse < best_sse - 1e-18:
                    best_sse = sse
                    best = np.zeros(4)
                    best[list(cols)] = coef
        c = best / scale
        return cls(intercept=float(c[0]), per_new=float(c[1]), per_pair=float(c[2]), per_cached=float(c[3]))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> "AttentionCostModel":
        return cls(**{k: float(d[k]) for k in ("intercept", "per_new", "per_pair", "per_cached")})
