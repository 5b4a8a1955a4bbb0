"""Time models of a forward pass: prefill from its (cached, new) pairs, decode from its contexts.

A prefill request with `cached` tokens already in KV and `new` tokens to compute costs
    per_new * new                          (projections, KV population)
  + per_pair * (new*cached + new(new+1)/2) (causal attention: new token i sees cached + i keys)
  + per_capped_pair * sum_i min(cached + i, pair_cap)
                                           (attention that sees at most pair_cap keys per query,
                                            e.g. DSA's top-k main attention; 0 unless pair_cap > 0)
  + per_cached * cached                    (streaming the cached KV through the kernel)
and a batch adds one `intercept` (launch overhead, or the weights streamed once per pass). The
coefficients come either from non-negative least squares on profiling samples taken on the real
engine (the four uncapped ones), or from an emulated target GPU (emulators/gpu, all five); this
module knows nothing about GPUs. Keeping every coefficient >= 0 keeps the time monotone in `new`,
which the chunking binary search relies on.

A decode step (DecodeCostModel) is one token per sequence; its cost is linear in the batch's
context lengths, with the same optional capped term.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from itertools import combinations

import numpy as np


def attention_pairs(cached: int, new: int) -> int:
    """(query, key) pairs of causal attention for `new` tokens after `cached` ones."""
    return new * cached + new * (new + 1) // 2


def capped_pairs(cached: int, new: int, cap: int) -> int:
    """(query, key) pairs when new token i (i = 1..new) sees min(cached + i, cap) keys.

    This is attention whose queries each read at most `cap` keys (DSA's top-k main attention).
    cap = 0 means no capped attention at all, so the count is 0 (it is min(., 0) summed); a
    negative cap is an error. Closed form: the first m = clamp(cap - cached, 0, new) tokens see
    cached + i keys, the remaining new - m see exactly cap.
    """
    if cap < 0:
        raise ValueError(f"pair cap must be >= 0, got {cap!r}")
    if new <= 0 or cap == 0:
        return 0
    m = min(max(cap - cached, 0), new)
    return m * cached + m * (m + 1) // 2 + (new - m) * cap


def _check_coefficients(obj: object, caps: dict[str, str]) -> None:
    """Every float field finite and >= 0; every cap an int >= 0; a capped coefficient > 0 needs
    its cap > 0 (otherwise the term could never apply and the number would be silently lost)."""
    for k, v in asdict(obj).items():
        if k in caps.values():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"cost model {k} must be an int >= 0, got {v!r}")
        else:
            try:
                ok = v >= 0 and math.isfinite(v)
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"cost model {k} must be finite and >= 0, got {v!r}")
    for coef, cap in caps.items():
        if getattr(obj, coef) > 0 and getattr(obj, cap) == 0:
            raise ValueError(f"cost model {coef} > 0 needs {cap} > 0")


def _cap_from(d: dict, key: str) -> int:
    """A cap read from a dict (JSON may carry 2048.0): absent means 0; non-integral is an error."""
    v = d.get(key, 0)
    try:
        ok = not isinstance(v, bool) and float(v).is_integer()
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"cost model {key} must be an int, got {v!r}")
    return int(v)


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
    per_capped_pair: float = 0.0
    pair_cap: int = 0

    def __post_init__(self) -> None:
        _check_coefficients(self, {"per_capped_pair": "pair_cap"})

    def request_cost(self, cached: int, new: int) -> float:
        """Seconds one request adds to a batch; 0 when it computes nothing. Non-decreasing in
        `new` (every term is a coefficient >= 0 times a count non-decreasing in `new`)."""
        if new <= 0:
            return 0.0
        t = self.per_new * new + self.per_pair * attention_pairs(cached, new)
        if self.per_capped_pair:
            t += self.per_capped_pair * capped_pairs(cached, new, self.pair_cap)
        return t + self.per_cached * cached

    def predict(self, batch: Iterable[tuple[int, int]]) -> float:
        """Predicted attention seconds of one forward pass. Sums in batch order, exactly as
        batching.pack_batch does, so both agree to the last bit."""
        t = self.intercept
        for cached, new in batch:
            t += self.request_cost(cached, new)
        return t

    @staticmethod
    def features(batch: Iterable[tuple[int, int]]) -> list[float]:
        """The four fitted features (intercept, new, pairs, cached); the capped term is never
        fitted, it only comes from an emulated target."""
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

        Fits the four uncapped coefficients (per_capped_pair stays 0). With four, exact NNLS is cheap by enumeration: solve ordinary least squares on
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

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, float | int]) -> "AttentionCostModel":
        """Inverse of to_dict; dicts written before the capped term existed load with it at 0."""
        return cls(**{k: float(d[k]) for k in ("intercept", "per_new", "per_pair", "per_cached")},
                   per_capped_pair=float(d.get("per_capped_pair", 0.0)), pair_cap=_cap_from(d, "pair_cap"))


@dataclass(frozen=True, slots=True)
class DecodeCostModel:
    """Seconds of one decode step of a batch: every sequence produces one token.

    step = intercept + sum over sequences of
           per_request + per_context * ctx + per_capped_context * min(ctx, context_cap)
    where ctx is the number of keys the sequence's new token attends to. The capped term (DSA's
    top-k main attention) applies only when context_cap > 0. An empty batch is no step: 0 s.
    """

    intercept: float = 0.0
    per_request: float = 0.0
    per_context: float = 0.0
    per_capped_context: float = 0.0
    context_cap: int = 0

    def __post_init__(self) -> None:
        _check_coefficients(self, {"per_capped_context": "context_cap"})

    def step_cost(self, contexts: Sequence[int]) -> float:
        if not contexts:
            return 0.0
        t = self.intercept
        cap = self.context_cap
        for ctx in contexts:
            if ctx < 0:
                raise ValueError(f"decode context must be >= 0, got {ctx!r}")
            t += self.per_request + self.per_context * ctx
            if cap > 0:
                t += self.per_capped_context * min(ctx, cap)
        return t

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, float | int]) -> "DecodeCostModel":
        """Inverse of to_dict; the capped term may be absent (a dense model's dict)."""
        return cls(**{k: float(d[k]) for k in ("intercept", "per_request", "per_context")},
                   per_capped_context=float(d.get("per_capped_context", 0.0)),
                   context_cap=_cap_from(d, "context_cap"))
