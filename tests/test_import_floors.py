"""The import graph, computed from the AST: every unit of the package (a top-level module or subpackage) sits on
a floor declared in docs/ARCHITECTURE.md's floors table; no import — module-level or inside a function — reaches
a higher floor, and no two units import each other, directly or round a circle. `if TYPE_CHECKING:` imports are
annotations only and do not count."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trt_diffusion"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def declared_floors(text: str) -> dict[str, int]:
    """unit -> floor from the table under '## Floors' (rows `| N name | `unit`, `unit/` ... | ...`)."""
    section = text.split("## Floors", 1)[1].split("\n## ", 1)[0]
    floors = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 2 or not re.match(r"^\d+\b", cells[0]):
            continue
        floor = int(re.match(r"^(\d+)", cells[0]).group(1))
        for unit in re.findall(r"`([\w.]+)/?`", cells[1]):
            floors[unit.removesuffix(".py")] = floor
    return floors


def _module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) for every trt_diffusion import in a module's source, relative ones resolved."""
    tree = ast.parse(source)
    skipped = _type_checking_lines(tree)
    base = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or target == "trt_diffusion":  # `from . import x`: x may be a module
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, target))
    return [(line, name) for line, name in found if name.startswith("trt_diffusion.")]


def unit_of(module: str) -> str:
    return module.split(".")[1]


def unit_edges(sources: dict[str, tuple[str, bool]]) -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the places ('module:line') that import across units."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, (source, is_package) in sources.items():
        for line, imported in imports_of(source, module, is_package):
            a, b = unit_of(module), unit_of(imported)
            if a != b:
                edges[(a, b)].append(f"{module}:{line}")
    return edges


def back_arrows(edges, floors: dict[str, int]) -> list[str]:
    return [f"{a} (floor {floors[a]}) imports {b} (floor {floors[b]}) at {', '.join(places)}"
            for (a, b), places in sorted(edges.items()) if floors.get(b, -1) > floors.get(a, -1)]


def circles(edges) -> list[list[str]]:
    """The strongly connected groups of more than one unit (Tarjan)."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def package_sources() -> dict[str, tuple[str, bool]]:
    sources = {}
    for path in PACKAGE.rglob("*.py"):
        module, is_package = _module_name(path)
        if module != "trt_diffusion":
            sources[module] = (path.read_text(), is_package)
    return sources


FLOORS = declared_floors(ARCHITECTURE.read_text())


def test_every_unit_has_a_floor():
    units = {unit_of(module) for module in package_sources()}
    assert sorted(units - set(FLOORS)) == [], "add the unit to docs/ARCHITECTURE.md's floors table"


def test_no_import_reaches_a_higher_floor():
    assert back_arrows(unit_edges(package_sources()), FLOORS) == []


def test_no_two_units_import_each_other():
    assert circles(unit_edges(package_sources())) == []


def test_an_injected_back_arrow_and_circle_are_caught():
    sources = package_sources()
    sources["trt_diffusion.errors_extra"] = ("def f():\n    from .cli import main\n", False)
    floors = {**FLOORS, "errors_extra": 0}
    arrows = back_arrows(unit_edges(sources), floors)
    assert any(a.startswith("errors_extra (floor 0) imports cli") for a in arrows), arrows
    sources["trt_diffusion.cli.loop"] = ("from ..errors_extra import f\n", False)
    assert ["cli", "errors_extra"] in circles(unit_edges(sources))


def test_type_checking_imports_do_not_count():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..cli import main\n"
    assert imports_of(source, "trt_diffusion.workspace.x", False) == []


@pytest.mark.parametrize("row,expected", [("| 0 ground | `errors`, `workspace/` | x |", {"errors": 0, "workspace": 0}),
                                          ("| unit | floor |", {})])
def test_the_floors_table_is_read(row, expected):
    assert declared_floors(f"## Floors\n\n{row}\n\n## Next\n") == expected
