"""The simulator's agents: a generated one's turns (lengths over one growing context) or a
replayed trace's (each turn its own prompt, named by its Full Blocks' keys)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TraceTurn:
    """One turn of a replayed trace agent (dualpath.workload.trace): its own prompt, not the
    previous context plus an append, so its hits come from a store shared by every agent."""

    prompt_len: int
    gen_len: int
    keys: tuple[int, ...]  # chained keys of the prompt's Full Blocks (equal exactly where prefixes are)
    at_s: float | None = None  # earliest start after the agent's arrival; None: after the previous turn


@dataclass
class TrajectorySpec:
    """One agent: its shared system prompt, its turns' (append, gen) lengths, when it arrives.
    With `trace_turns` it replays those instead (`turns` then only counts them: (prompt, gen))."""

    id: int
    system_prompt_len: int
    turns: Sequence[tuple[int, int]]
    arrival_s: float = 0.0  # simulation seconds after the start (every group's leader has reported)
    trace_turns: Sequence[TraceTurn] | None = None

    @property
    def n_requests(self) -> int:
        return len(self.trace_turns) if self.trace_turns is not None else len(self.turns)

    def joined_at(self, turn: int, turns: int | None = None) -> "TrajectorySpec":
        """The agent from its `turn`-th turn on (`turns` of them; None: the rest), the context
        before it folded into its stored prefix: its first request reads it all back."""
        earlier = sum(a + g for a, g in self.turns[:turn])
        end = None if turns is None else turn + turns
        return replace(self, system_prompt_len=self.system_prompt_len + earlier, turns=tuple(self.turns[turn:end]))


def context_keys(trajectory: int, shared_blocks: int, n_blocks: int) -> list[int]:
    """Keys of a generated agent's first `n_blocks` context blocks: the shared system prompt's
    Full Blocks are every agent's, the rest its own (its turns append to one context)."""
    own = (trajectory + 1) << 32
    return [b if b < shared_blocks else own | b for b in range(n_blocks)]
