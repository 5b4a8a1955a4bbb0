"""Reading a topology file safely, before any field is judged: a regular file of bounded size, UTF-8, YAML with bounded nesting, nodes, scalars and integers; every refusal one line naming the file, the line and the fix."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml


MAX_FILE_BYTES = 64 << 10  # the shipped topologies are about 1.2 KiB


MAX_DEPTH = 16  # a topology nests 2 levels (storage:, target:)


MAX_NODES = 2000  # YAML nodes once aliases are expanded (a topology has about 40)


MAX_SCALAR_CHARS = 4096  # the longest scalar is a description


MAX_INT_DIGITS = 18  # every integer field is < 10^4; 18 digits still fits int64


class TopologyError(ValueError):
    """A topology file is unusable. The message is one line: file, field, fix."""


class _Bounded(yaml.SafeLoader):
    """SafeLoader whose composer refuses nesting deeper than MAX_DEPTH, naming the field."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._path: list[str] = []

    def compose_node(self, parent: Any, index: Any) -> Any:  # noqa: D401 - PyYAML's hook
        name = index.value if isinstance(index, yaml.ScalarNode) else (str(index) if index is not None else "")
        self._path.append(_short_name(name))
        try:
            if len(self._path) > MAX_DEPTH + 1:  # +1: the document's root node
                raise _LoadError(f"nesting deeper than {MAX_DEPTH} levels", ".".join(p for p in self._path[1:] if p),
                                 "a topology nests at most two levels (storage:, target:); see topologies/1p1d.yaml",
                                 self.peek_event().start_mark if self.check_event() else None)
            return super().compose_node(parent, index)
        finally:
            self._path.pop()


class _LoadError(Exception):
    def __init__(self, problem: str, field: str, fix: str, mark: Any = None) -> None:
        super().__init__(problem)
        self.problem, self.field, self.fix, self.mark = problem, field, fix, mark


def _short_name(name: str, limit: int = 40) -> str:
    name = "".join(c if c.isprintable() else "?" for c in str(name))
    return name if len(name) <= limit else name[: limit - 3] + "..."


def _source(path: Path) -> str:
    """The path for a one-line message (a name with a newline or escapes is shown as a repr)."""
    text = str(path)
    return text if text.isprintable() and len(text) <= 300 else repr(text)[:300]


def _read(path: Path, src: str) -> str:
    """At most MAX_FILE_BYTES of a regular file, as text. Never blocks on a FIFO or a device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise TopologyError(f"{src}: cannot read topology file ({e.strerror}); fix: check the path") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket or other")
            raise TopologyError(f"{src}: is {kind}, not a regular file; fix: give the path of a topology YAML file")
        chunks, got = [], 0
        while got <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise TopologyError(f"{src}: cannot read topology file ({e.strerror}); fix: check the path") from None
    finally:
        os.close(fd)
    if got > MAX_FILE_BYTES:
        raise TopologyError(f"{src}: larger than {MAX_FILE_BYTES // 1024} KiB, not a topology file; "
                            "fix: give a topology YAML file (see topologies/1p1d.yaml)")
    raw = b"".join(chunks)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise TopologyError(f"{src}: line {line}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
                            "fix: save the file as UTF-8") from None


def _check_tree(node: Any) -> None:
    """Bound the composed tree before anything is constructed: nodes once aliases are expanded,
    scalar lengths, integer sizes and duplicate keys. Raises _LoadError naming the field."""
    sizes: dict[int, int] = {}
    busy: set[int] = set()

    def walk(n: Any, path: tuple[str, ...]) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        field = ".".join(p for p in path if p) or "(top level)"
        if id(n) in busy:
            raise _LoadError("an alias that refers to itself", field, "remove the recursive alias", n.start_mark)
        busy.add(id(n))
        total = 1
        if isinstance(n, yaml.ScalarNode):
            if n.tag == "tag:yaml.org,2002:int" and len(n.value) > MAX_INT_DIGITS:
                digits = sum(c.isdigit() for c in n.value)
                raise _LoadError(f"an integer of {digits} digits", field,
                                 "use a number in the field's range (see topologies/1p1d.yaml)", n.start_mark)
            if len(n.value) > MAX_SCALAR_CHARS:
                raise _LoadError(f"a value of {len(n.value)} characters", field,
                                 f"keep every value to at most {MAX_SCALAR_CHARS} characters", n.start_mark)
        elif isinstance(n, yaml.SequenceNode):
            for i, child in enumerate(n.value):
                total += walk(child, (*path, f"[{i}]"))
                if total > MAX_NODES:
                    break
        elif isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for k, v in n.value:
                name = _short_name(k.value) if isinstance(k, yaml.ScalarNode) else "?"
                if isinstance(k, yaml.ScalarNode) and k.value in seen and name != "<<":
                    raise _LoadError("appears twice", ".".join((*[p for p in path if p], name)),
                                     "keep one of them", k.start_mark)
                seen.add(k.value if isinstance(k, yaml.ScalarNode) else "")
                total += walk(k, (*path, name)) + walk(v, (*path, name))
                if total > MAX_NODES:
                    break
        busy.discard(id(n))
        if total > MAX_NODES:
            raise _LoadError(f"more than {MAX_NODES} YAML nodes once aliases are expanded", field,
                             "write the topology out without nested aliases (see topologies/1p1d.yaml)",
                             n.start_mark)
        sizes[id(n)] = total
        return total

    walk(node, ())


def _parse_yaml(text: str, src: str) -> Any:
    loader = None
    try:
        loader = _Bounded(text)  # its reader already refuses unprintable characters
        node = loader.get_single_node()
        if node is None:
            return None
        _check_tree(node)
        return loader.construct_document(node)
    except _LoadError as e:
        line = f" line {e.mark.line + 1}:" if e.mark is not None else ""
        raise TopologyError(f"{src}:{line} field '{e.field}' has {e.problem}; fix: {e.fix}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" line {where.line + 1}:" if where else ""
        problem = _short_name(getattr(e, "problem", None) or type(e).__name__, 80)
        raise TopologyError(f"{src}:{line} not valid YAML ({problem}); fix: the YAML syntax "
                            "(see topologies/1p1d.yaml)") from None
    except (RecursionError, ValueError, OverflowError, TypeError) as e:  # a constructor refused a value
        raise TopologyError(f"{src}: unusable YAML value ({_short_name(type(e).__name__ + ': ' + str(e), 80)}); "
                            "fix: see topologies/1p1d.yaml for valid values") from None
    finally:
        if loader is not None:
            loader.dispose()
