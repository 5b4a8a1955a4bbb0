"""A team's own KV connector behind the engines' connector interfaces: the contract and its loader.

`dualpath run --connector MODULE:CLASS` (or `connector:` in a topology) names a `ConnectorPlugin`
subclass. Its `prefill` class replaces the layerwise connector (modes layerwise and every dualpath
mode: both read paths); its `decode` class replaces the decode engine's buffer connector (every
mode that moves KV). basic and oracle keep the built-in prefill connectors: they are the baselines
a plug-in is measured against. docs/connectors.md states the contract call by call.

The engines never trust a plug-in's own account of what it loaded: `CheckedPrefill` and
`CheckedDecode` hash the KV it hands the model and check its shape, so the verdicts (bit-exact
tokens and KV, bytes per NIC, the traffic class, FAITHFUL time) are the same ones the built-in
connectors get, computed outside the code under test.
"""
from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dualpath.kv.check import layer_hash
from dualpath.kv.connector import KV, KVConnector, LoadPlan
from dualpath.kv.decode_connector import DecodeConnector, DecodePlan
from dualpath.kv.layouts import BlockGeometry

CONTRACT_VERSION = 1  # bump when a call's arguments or its promises change


class ConnectorError(ValueError):
    """A plug-in that cannot be loaded, or one that broke the contract (one line)."""


class ConnectorPlugin:
    """Subclass this and set `prefill` and/or `decode` (None keeps the built-in one)."""

    contract_version: int = CONTRACT_VERSION
    name: str = ""
    prefill: type[KVConnector] | None = None
    decode: type[DecodeConnector] | None = None


def parse_spec(spec: str, base: Path | None = None) -> tuple[str, str, Path | None]:
    """'MODULE:CLASS' or 'FILE.py:CLASS' -> (module name, class name, directory to import from).
    A relative FILE is taken from `base` (a topology's folder) or the working directory."""
    text = str(spec).strip()
    if text.count(":") != 1 or not all(text.split(":")):
        raise ConnectorError(f"connector {spec!r}: expected MODULE:CLASS or FILE.py:CLASS "
                             f"(e.g. simple_layerwise:SimpleConnectors)")
    mod, cls = text.split(":")
    if not cls.isidentifier():
        raise ConnectorError(f"connector {spec!r}: {cls!r} is not a Python class name")
    if mod.endswith(".py"):
        path = Path(mod)
        if not path.is_absolute():
            path = (base or Path.cwd()) / path
        if not path.is_file():
            raise ConnectorError(f"connector {spec!r}: no file {path}")
        return path.stem, cls, path.resolve().parent
    if not all(p.isidentifier() for p in mod.split(".")):
        raise ConnectorError(f"connector {spec!r}: {mod!r} is not a module name")
    return mod, cls, None


def load_plugin(module: str, cls: str, path: Path | str | None = None) -> type[ConnectorPlugin]:
    """Import `module` (from `path` first, when given) and check `cls` against the contract."""
    if path is not None and str(path) not in sys.path:
        sys.path.insert(0, str(path))
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        where = f" in {path} or" if path else ""
        raise ConnectorError(f"connector {module}:{cls}: module {e.name!r} not found{where} on the import path; "
                             f"fix: add its folder to PYTHONPATH or give FILE.py:CLASS") from None
    except Exception as e:  # a plug-in's import-time error is the user's, shown in one line
        raise ConnectorError(f"connector {module}:{cls}: importing {module} failed: "
                             f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    if path is not None and import_root(mod) != Path(path).resolve():
        raise ConnectorError(f"connector {module}:{cls}: the name {module!r} is taken by {mod.__file__}; "
                             f"fix: rename the plug-in's file")
    plugin = getattr(mod, cls, None)
    if plugin is None:
        raise ConnectorError(f"connector {module}:{cls}: {module} has no {cls!r}")
    check_plugin(plugin, f"{module}:{cls}")
    return plugin


def check_plugin(plugin: object, label: str) -> None:
    """The contract's static half: a ConnectorPlugin of this version with concrete connector classes."""
    if not (inspect.isclass(plugin) and issubclass(plugin, ConnectorPlugin)):
        raise ConnectorError(f"connector {label}: not a subclass of dualpath.kv.plugin.ConnectorPlugin")
    if plugin.contract_version != CONTRACT_VERSION:
        raise ConnectorError(f"connector {label}: written for contract version {plugin.contract_version!r}, "
                             f"this testbed speaks version {CONTRACT_VERSION} (docs/connectors.md)")
    if plugin.prefill is None and plugin.decode is None:
        raise ConnectorError(f"connector {label}: sets neither `prefill` nor `decode`")
    for side, base in (("prefill", KVConnector), ("decode", DecodeConnector)):
        c = getattr(plugin, side)
        if c is None:
            continue
        if not (inspect.isclass(c) and issubclass(c, base)):
            raise ConnectorError(f"connector {label}: `{side}` must be a subclass of "
                                 f"{base.__module__}.{base.__name__}")
        if inspect.isabstract(c):
            missing = ", ".join(sorted(c.__abstractmethods__))
            raise ConnectorError(f"connector {label}: `{side}` ({c.__name__}) does not implement {missing}")


@dataclass(frozen=True)
class ConnectorRef:
    """A plug-in as the engines import it: the module, the class and the folder it came from."""

    spec: str  # as the user wrote it
    module: str
    cls: str
    path: Path  # the import root that holds `module`

    def engine_args(self) -> list[str]:
        return ["--connector", f"{self.module}:{self.cls}", "--connector-path", str(self.path)]


def resolve(spec: str, base: Path | None = None) -> tuple[ConnectorRef, type[ConnectorPlugin]]:
    """Parse and load `spec` here, before anything starts, and find the folder the engines, whose
    working directory and import path differ from the caller's, must import it from."""
    module, cls, path = parse_spec(spec, base)
    plugin = load_plugin(module, cls, path)
    return ConnectorRef(spec, module, cls, import_root(sys.modules[module])), plugin


def import_root(mod: object) -> Path:
    """The sys.path folder a module was imported from (above its packages, for a dotted name)."""
    origin = Path(getattr(mod, "__file__", None) or "").resolve()
    root = origin.parent if origin.name != "__init__.py" else origin.parent.parent
    for _ in range(getattr(mod, "__name__", "").count(".")):
        root = root.parent
    return root


def describe(plugin: type[ConnectorPlugin], spec: str) -> dict:
    """What summary.json records of the plug-in a run used."""
    return {"spec": spec, "name": plugin.name or plugin.__name__, "contract_version": plugin.contract_version,
            "prefill": plugin.prefill.__name__ if plugin.prefill else None,
            "decode": plugin.decode.__name__ if plugin.decode else None}


def connector_name(conn: object) -> str:
    """The class that moved a request's KV (a plug-in's own, not its checking wrapper's)."""
    return type(getattr(conn, "inner", conn)).__name__


def _check_kv(kv: object, n: int, geom: BlockGeometry, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    want = (n, geom.n_kv_heads, geom.head_dim)
    if not (isinstance(kv, tuple) and len(kv) == 2 and all(isinstance(t, torch.Tensor) for t in kv)):
        raise ConnectorError(f"{what}: returned {type(kv).__name__}, not a (K, V) pair of tensors")
    for name, t in zip("KV", kv):
        if tuple(t.shape) != want or t.dtype != geom.dtype:
            raise ConnectorError(f"{what}: {name} is {tuple(t.shape)} {t.dtype}, the contract says {want} {geom.dtype}")
    return kv


class CheckedPrefill:
    """A plug-in's prefill connector as the engine uses it: its KV hashed and shape-checked here."""

    def __init__(self, inner: KVConnector, geom: BlockGeometry) -> None:
        self.inner, self.geom = inner, geom
        self._hashes: list[str] = []

    def start_load(self, plan: LoadPlan) -> None:
        self.plan = plan
        self.inner.start_load(plan)

    def wait_for_layer(self, layer: int) -> KV | None:
        kv = self.inner.wait_for_layer(layer)
        what = f"request {self.plan.request} layer {layer}: {type(self.inner).__name__}.wait_for_layer"
        if not self.plan.n_past:
            if kv is not None:
                raise ConnectorError(f"{what}: returned KV for a request with no past (the contract says None)")
            return None
        k, v = _check_kv(kv, self.plan.n_past, self.geom, what)
        self._hashes.append(layer_hash(k, v, self.geom))
        return k, v

    def save_layer(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        self.inner.save_layer(layer, k_new, v_new)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    @property
    def stats(self):
        return replace(self.inner.stats, layer_hashes=list(self._hashes))


class CheckedDecode:
    """A plug-in's decode connector as the decode engine uses it (see CheckedPrefill)."""

    def __init__(self, inner: DecodeConnector, geom: BlockGeometry) -> None:
        self.inner, self.geom = inner, geom
        self._hashes: list[str] = []

    def start_load(self, plan: DecodePlan) -> None:
        self.plan = plan
        self.inner.start_load(plan)

    def poll_load(self) -> list[KV] | None:
        kv = self.inner.poll_load()
        if kv is None:
            return None
        what = f"request {self.plan.request}: {type(self.inner).__name__}.poll_load"
        if not isinstance(kv, list) or len(kv) != self.geom.n_layer:
            raise ConnectorError(f"{what}: returned {type(kv).__name__} "
                                 f"{len(kv) if isinstance(kv, list) else ''}, not a list of {self.geom.n_layer} layers")
        out = []
        for layer, x in enumerate(kv):
            k, v = _check_kv(x, self.plan.n_prompt, self.geom, f"{what} layer {layer}")
            self._hashes.append(layer_hash(k, v, self.geom))
            out.append((k, v))
        return out

    def save_block(self, block: int, kv: list[KV]) -> None:
        self.inner.save_block(block, kv)

    def poll_save(self) -> bool:
        return bool(self.inner.poll_save())

    def close(self) -> None:
        self.inner.close()

    @property
    def stats(self):
        return replace(self.inner.stats, layer_hashes=list(self._hashes))
