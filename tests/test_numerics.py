"""Portable kernels (dualpath/model/numerics.py): asked for in time they take, asked for late they
refuse loudly, and a server whose probe hashes otherwise is a prepare problem."""
from __future__ import annotations

import os
import subprocess
import sys

from dualpath.model.numerics import PORTABLE_KERNELS
from testbed.api import demo_checkpoint
from testbed.fabric import remote
from testbed.paths import REPO
from testbed.topology_servers import ServerSpec

_PROBE = "from dualpath.model.numerics import probe_hash; from pathlib import Path; print(probe_hash(Path({ckpt!r})))"


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in PORTABLE_KERNELS}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**base, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})})


def test_asked_for_in_time_the_kernels_are_the_environment_s():
    ckpt = str(demo_checkpoint())
    late = _python("from dualpath.model.numerics import use_portable_kernels; use_portable_kernels(); "
                   + _PROBE.format(ckpt=ckpt))
    from_start = _python(_PROBE.format(ckpt=ckpt), env=PORTABLE_KERNELS)
    assert late.returncode == 0 and from_start.returncode == 0, late.stderr + from_start.stderr
    assert late.stdout.strip() == from_start.stdout.strip()
    assert len(late.stdout.strip()) == 16


def test_asked_for_after_a_tensor_operation_it_refuses():
    p = _python("import torch; torch.ones(4).exp(); print(torch.backends.cpu.get_cpu_capability())\n"
                "from dualpath.model.numerics import use_portable_kernels, NumericsError\ntry:\n"
                " use_portable_kernels()\nexcept NumericsError as e:\n print('refused', e)")
    assert p.returncode == 0, p.stderr
    native, *rest = p.stdout.strip().splitlines()
    # a CPU with no vector kernels at all runs DEFAULT already: nothing to refuse there
    assert rest == [] if native == "DEFAULT" else rest[0].startswith(f"refused torch already runs its {native} kernels")


def test_the_cli_module_needs_a_checkpoint():
    p = _python("import sys; from dualpath.model.numerics import main; sys.exit(main(['/nonexistent-dpt']))")
    assert p.returncode == 2 and "no checkpoint at /nonexistent-dpt" in p.stderr


def test_a_server_that_hashes_otherwise_is_a_problem(monkeypatch):
    srv = ServerSpec(name="b", ssh="root@192.0.2.9")
    monkeypatch.setattr(remote, "numerics_hash", lambda server, ckpt: ("0123456789abcdef", ""))
    assert remote._numerics_check(srv, demo_checkpoint(), ("0123456789abcdef", "")).ok
    bad = remote._numerics_check(srv, demo_checkpoint(), ("fedcba9876543210", ""))
    assert not bad.ok and "0123456789abcdef there, fedcba9876543210 here" in bad.detail
    monkeypatch.setattr(remote, "numerics_hash", lambda server, ckpt: (None, "No module named torch"))
    none = remote._numerics_check(srv, demo_checkpoint(), ("fedcba9876543210", ""))
    assert not none.ok and "No module named torch" in none.detail


def test_node_processes_elsewhere_get_the_kernel_choice(monkeypatch):
    from testbed.cluster.processes import _remote_env

    for k in PORTABLE_KERNELS:
        monkeypatch.delenv(k, raising=False)
    assert not set(PORTABLE_KERNELS) & set(_remote_env())
    for k, v in PORTABLE_KERNELS.items():
        monkeypatch.setenv(k, v)
    assert {k: _remote_env()[k] for k in PORTABLE_KERNELS} == PORTABLE_KERNELS
