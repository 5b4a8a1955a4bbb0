"""Running commands in the root namespace or in one of the testbed's namespaces."""
from __future__ import annotations

import subprocess
from collections.abc import Sequence


class CommandError(RuntimeError):
    pass


def ns_argv(ns: str | None, argv: Sequence[str]) -> list[str]:
    """argv prefixed to run inside named namespace `ns` (None: root namespace)."""
    return (["ip", "netns", "exec", ns] if ns else []) + list(argv)


def run(argv: Sequence[str], ns: str | None = None, stdin: str | None = None,
        check: bool = True, timeout: float = 30) -> str:
    """Run a command to completion and return its stdout; raise CommandError on failure."""
    full = ns_argv(ns, argv)
    try:
        p = subprocess.run(full, input=stdin, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise CommandError(f"{full[0]}: command not found; run scripts/bootstrap.sh") from None
    except subprocess.TimeoutExpired:
        raise CommandError(f"timed out after {timeout:g}s: {' '.join(full)}") from None
    if check and p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise CommandError(f"{' '.join(full)} failed: {msg[-1] if msg else 'exit ' + str(p.returncode)}")
    return p.stdout
