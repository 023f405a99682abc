"""Load YAML while remembering the line of every key and item, so errors can point at the file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import ConfigError

Path_ = tuple  # a field path: ("models", "sd15", "buckets", 0)

MAX_DEPTH = 64  # engines.yaml nests 6 levels; the composer recurses (a deeper file is an attack or a mistake)
MAX_NODES = 100_000  # a large engines.yaml has a few thousand
MERGE_TAG = "tag:yaml.org,2002:merge"


class _Refused(Exception):
    def __init__(self, mark, problem: str):
        self.mark, self.problem = mark, problem


class _Loader(yaml.SafeLoader):
    """SafeLoader's composer without aliases (`*name` expands without bound: 443 bytes took 2.4 GB, a
    recursive one never ends) and with bounded depth and size."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = self._nodes = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise _Refused(self.peek_event().start_mark, "YAML aliases (*name) are not allowed in this file; "
                                                         "write the values out")
        self._depth += 1
        self._nodes += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(self.peek_event().start_mark, f"nested deeper than {MAX_DEPTH} levels")
        if self._nodes > MAX_NODES:
            raise _Refused(self.peek_event().start_mark, f"more than {MAX_NODES} values")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


@dataclass
class LocatedYaml:
    data: object
    lines: dict[Path_, int] = field(default_factory=dict)  # 1-based line of each path
    duplicates: list[tuple[Path_, int]] = field(default_factory=list)

    def line_of(self, path: Path_) -> int | None:
        """The line of `path`, or of its closest ancestor that has one."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)


def load_located_yaml(path: Path) -> LocatedYaml:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); a YAML file is expected") from None
    try:
        node = yaml.compose(text, Loader=_Loader)
    except _Refused as exc:
        raise ConfigError(f"{path}:{exc.mark.line + 1}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    located = LocatedYaml(data=None)
    if node is None:
        located.data = {}
        return located
    try:
        located.data = _construct(node, (), located, yaml.SafeLoader(""))
    except _Refused as exc:
        raise ConfigError(f"{path}:{exc.mark.line + 1}: {exc.problem}") from None
    return located


def _construct(node: yaml.Node, path: Path_, located: LocatedYaml, scalars: yaml.SafeLoader):
    """Plain data from the node tree, recording each path's line; `scalars` resolves scalar values."""
    located.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        result: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == MERGE_TAG:
                raise _Refused(key_node.start_mark, "YAML merge keys (<<) are not allowed in this file; "
                                                    "write the keys out")
            # A mapping or list used as a key is not valid engines.yaml: name it so the schema rejects it.
            key = _scalar(key_node, scalars) if isinstance(key_node, yaml.ScalarNode) else "None"
            child = path + (key,)
            if key in result:
                located.duplicates.append((child, key_node.start_mark.line + 1))
            located.lines[child] = key_node.start_mark.line + 1
            result[key] = _construct(value_node, child, located, scalars)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_construct(item, path + (i,), located, scalars) for i, item in enumerate(node.value)]
    return _scalar(node, scalars)


def _scalar(node: yaml.Node, scalars: yaml.SafeLoader):
    try:
        return scalars.construct_object(node)
    except (yaml.YAMLError, ValueError, OverflowError) as exc:  # 2001-13-45, a bad !!binary, an unknown tag
        problem = getattr(exc, "problem", None) or str(exc)
        raise _Refused(node.start_mark, f"cannot read the value {node.value!r}: {problem}") from None
