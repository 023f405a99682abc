"""Load YAML while remembering the line of every key and item, so errors can point at the file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import ConfigError

Path_ = tuple  # a field path: ("models", "sd15", "buckets", 0)


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
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    located = LocatedYaml(data=None)
    if node is None:
        located.data = {}
        return located
    located.data = _construct(node, (), located, yaml.SafeLoader(""))
    return located


def _construct(node: yaml.Node, path: Path_, located: LocatedYaml, scalars: yaml.SafeLoader):
    """Plain data from the node tree, recording each path's line; `scalars` resolves scalar values."""
    located.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        result: dict = {}
        for key_node, value_node in node.value:
            # A mapping or list used as a key is not valid engines.yaml: name it so the schema rejects it.
            key = scalars.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else "None"
            child = path + (key,)
            if key in result:
                located.duplicates.append((child, key_node.start_mark.line + 1))
            located.lines[child] = key_node.start_mark.line + 1
            result[key] = _construct(value_node, child, located, scalars)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_construct(item, path + (i,), located, scalars) for i, item in enumerate(node.value)]
    return scalars.construct_object(node)
