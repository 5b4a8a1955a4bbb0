"""Running a lifecycle generator (request.py, prefill.py) on an executor: with asyncio (the
testbed's conductor) or inside a SimPy process (the simulator)."""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any

from dualpath.lifecycle.steps import StepError


async def run_async(steps: Generator[Any, Any, Any], perform: Callable[[Any], Awaitable[Any]],
                    failures: tuple[type[BaseException], ...] = ()) -> Any:
    """Perform each step with `await perform(step)` and send its outcome back. What a step raises
    goes into the lifecycle: as a StepError when it is one of `failures` (an executor's own
    errors a request survives), as itself otherwise (so cleanup steps still run)."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.throw(error) if error is not None else steps.send(value)
        except StopIteration as stop:
            return stop.value
        try:
            value, error = await perform(step), None
        except StepError as e:
            value, error = None, e
        except failures as e:
            value, error = None, StepError(str(e), cause=e)
        except BaseException as e:  # noqa: B036 - cancellation too: the lifecycle frees its areas
            value, error = None, e


def run_in_process(steps: Generator[Any, Any, Any],
                   perform: Callable[[Any], Generator[Any, Any, Any]]) -> Generator[Any, Any, Any]:
    """The same inside a SimPy process: `yield from run_in_process(...)`, where
    `perform(step)` is a generator of SimPy events that returns the step's outcome."""
    value: Any = None
    while True:
        try:
            step = steps.send(value)
        except StopIteration as stop:
            return stop.value
        value = yield from perform(step)
