import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

# the store tests' server fixtures; SmolLM2; the dualpath_testbed fixture (also an entry point of the
# package: named here for a venv installed before it existed)
pytest_plugins = ["tests.store_helpers", "tests.smollm2_helpers", "testbed.pytest_plugin"]

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "testbed.cli"]



# Generous on purpose: the bound catches a hang or a blow-up (an alias bomb, quadratic parsing), not
# a slow machine. CI's 2 cores once took 2.03 s under tracemalloc for a 0.22 s parse, so time is
# measured on a separate call without tracemalloc, and speed belongs in benchmarks.
BOUNDED_S = 10.0
BOUNDED_BYTES = 64 << 20


def within_bounds(fn, max_bytes: int = BOUNDED_BYTES):
    """fn() run twice: once under tracemalloc for its peak, once timed. Returns the timed result."""
    tracemalloc.start()
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    t0 = time.monotonic()
    out = fn()
    took = time.monotonic() - t0
    assert took < BOUNDED_S and peak < max_bytes, (took, peak)
    return out


def raises_bounded(exc: type[BaseException], call, *args, **kw) -> BaseException:
    """The exception `call` raises, checked to come within BOUNDED_S and BOUNDED_BYTES of peak."""
    def caught() -> BaseException:
        with pytest.raises(exc) as e:
            call(*args, **kw)
        return e.value
    return within_bounds(caught)


def is_root() -> bool:
    return os.geteuid() == 0


needs_root = pytest.mark.skipif(not is_root(), reason="needs root (namespaces, tc)")


def dualpath(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run the CLI as a user would, in a child process."""
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the suite on a clean machine: a run that was killed before this suite (a CI job cut off,
    a session's stray run) leaves dpt-* namespaces behind, and the tests that refuse leftovers, as a
    user's testbed must, would then fail for what they did not do. Only the testbed's own prefixed
    leftovers are removed, and the suite says what it removed."""
    if not is_root():
        return
    from testbed.fabric.cleanup import clean, find_leftovers, live_owners

    live = live_owners()
    if live:  # a run in progress (a reproduce, a demo) is not a leftover: never destroy it
        print(f"\ntests: a testbed is up, held by pid {', '.join(map(str, sorted(live)))}; leaving it alone, "
              f"so the tests that bring up their own skip")
        return
    if not find_leftovers().empty():
        found = clean(verbose=False)
        print(f"\ntests: removed leftovers of an earlier testbed run before the suite: {found.summary()}")


def own_the_machine() -> None:
    """Before a test brings its own testbed up: skip while another run holds one (cleaning would
    destroy a reproduce or a demo in progress), else remove an earlier run's leftovers."""
    from testbed.fabric.cleanup import clean, find_leftovers, live_owners

    live = live_owners()
    if live:
        pytest.skip(f"the machine holds one testbed at a time, and pid {', '.join(map(str, sorted(live)))} "
                    f"holds one up now")
    if not find_leftovers().empty():
        clean(verbose=False)


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves anything of the testbed behind; cleans up either way."""
    from testbed.fabric.cleanup import clean, find_leftovers, live_owners

    live = live_owners()
    if live:
        pytest.skip(f"the machine holds one testbed at a time, and pid {', '.join(map(str, sorted(live)))} "
                    f"holds one up now")
    before = find_leftovers()
    if not before.empty():
        clean(verbose=False)
    yield
    if live_owners():  # another suite brought its testbed up meanwhile: cleaning would destroy it
        return
    left = find_leftovers()
    clean(verbose=False)
    assert left.empty(), f"the test leaked: {left}"
