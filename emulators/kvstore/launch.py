"""Run a storage server as a subprocess and learn its address.

Used by tests and benchmarks here, and by the testbed, which passes a `wrap` (e.g. the command
that enters a storage host's namespace, here or on another server).
"""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from dualpath.store.protocol import parse_address

REPO_ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        listen: str = "127.0.0.1:0",
        extra_args: Sequence[str] = (),
        python: str = sys.executable,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 30.0,
        block_bytes: int = 0,
        module: str = "emulators.kvstore",
        wrap: Callable[[list[str]], list[str]] | None = None,
        root_here: bool = True,
    ) -> None:
        """`block_bytes`: the one block size the server accepts (0: any up to its maximum);
        a run passes its Full Block size so a put of any other size is refused. `module`: the
        server to run (emulators.mooncake_store for a Mooncake Store storage host). `wrap`: the
        whole command line made into the one that runs it where the server lives (the testbed's
        Fabric.exec_argv: in a namespace here, or over SSH on another server, whose python it
        picks). `root_here`: False when `root` is on another server (the
        server makes it there)."""
        self.root = Path(root)
        self.root_here = root_here
        core = [
            python,
            "-m",
            module,
            "--listen",
            listen,
            "--root",
            str(self.root),
            "--capacity-bytes",
            str(capacity_bytes),
            *(["--block-bytes", str(block_bytes)] if block_bytes else []),
            *extra_args,
        ]
        self.argv = wrap(core) if wrap is not None else core
        self.log_path = Path(log_path) if log_path is not None else self.root.parent / f"{self.root.name}.server.log"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.address: tuple[str, int] | None = None

    def start(self) -> tuple[str, int]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        if self.root_here:
            self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT)
        try:
            self.address = self._await_listening()
        except BaseException:
            self.kill()
            raise
        return self.address

    def _await_listening(self) -> tuple[str, int]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + self.startup_timeout_s
        line = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"store server did not start within {self.startup_timeout_s}s; see {self.log_path}")
                if not sel.select(timeout=left):
                    continue
                ch = os.read(self.proc.stdout.fileno(), 1)
                if not ch:
                    raise RuntimeError(f"store server exited with {self.proc.wait(5)}; see {self.log_path}")
                line += ch
        text = line.decode().strip()
        if not text.startswith("LISTENING "):
            raise RuntimeError(f"unexpected server output {text!r}")
        return parse_address(text.split(" ", 1)[1])

    @property
    def address_str(self) -> str:
        assert self.address is not None
        host, port = self.address
        return f"{host}:{port}"

    def kill(self) -> None:
        """SIGKILL: the crash case. No cleanup runs in the server."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self._reap()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._reap()

    def _reap(self) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(10)
            finally:
                if self.proc.stdout is not None:
                    self.proc.stdout.close()

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
