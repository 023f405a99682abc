"""Generate the TensorRT Python API names removed between two releases, from NVIDIA/TensorRT's binding sources.

    python scripts/tensorrt_removed_api.py --git-dir /path/to/NVIDIA/TensorRT/.git \
        --old release/10.13 --new release/11.1 --out trt_diffusion/targets/tensorrt/removed_api.json

Reads `python/src/**/*.cpp` (the pybind11 bindings: `py::class_`/`py::enum_` names, `.def*("name")`,
`.value("NAME")`, `m.def("name")`) of both releases straight from git (`git show REF:path`), no checkout,
and writes what the old release binds and the new one does not: classes, enum members, class members, module
functions, with the commits read. tests/targets/test_tensorrt_removed_api.py scans the code with that list.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

DECL = re.compile(r"py::(class_|enum_)\s*<(?:[^;{}]|\{[^{}]*\})*?>\s*(\w+)?\s*[({]\s*(\w+)\s*,\s*\"(\w+)\"", re.S)
MEMBER = re.compile(r"\.\s*(def|def_static|def_property|def_property_readonly|def_readwrite|def_readonly|value)\s*"
                    r"\(\s*\"(\w+)\"")
MODULE_DEF = re.compile(r"(?<![\w.])(\w+)\s*\.\s*def\s*\(\s*\"(\w+)\"")


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True).stdout


def _statement_end(text: str, start: int) -> int:
    """Index of the `;` that ends the statement starting at `start` (strings, chars and comments skipped)."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "'":
            i += 1
            while i < n and text[i] != c:
                i += 2 if text[i] == "\\" else 1
        elif text.startswith("R\"", i - 1) and c == '"':
            pass
        elif text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            i = text.find("*/", i) + 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == ";" and depth <= 0:
            return i
        i += 1
    return n


def _strip_raw_strings(text: str) -> str:
    return re.sub(r'R"(\w*)\((.*?)\)\1"', '""', text, flags=re.S)


def bindings(sources: list[str]) -> dict:
    """{"classes": {name: kind}, "members": {class: set}, "functions": set} of a set of binding sources."""
    classes: dict[str, str] = {}
    members: dict[str, set[str]] = {}
    functions: set[str] = set()
    for raw in sources:
        text = _strip_raw_strings(raw)
        variables: dict[str, str] = {}
        module_names: set[str] = set()
        for match in DECL.finditer(text):
            kind, variable, module, name = match.groups()
            module_names.add(module)
            classes[name] = "enum" if kind == "enum_" else "class"
            statement = text[match.start():_statement_end(text, match.end())]
            members.setdefault(name, set()).update(m.group(2) for m in MEMBER.finditer(statement))
            if variable:
                variables[variable] = name
        for match in MODULE_DEF.finditer(text):
            owner, name = match.groups()
            if owner in variables:  # `engine.def("x")` on a class bound to a variable
                statement = text[match.start():_statement_end(text, match.start())]
                members[variables[owner]].update(m.group(2) for m in MEMBER.finditer(statement))
            elif owner in module_names or owner == "m":
                functions.add(name)
    return {"classes": classes, "members": members, "functions": functions}


def read_release(git_dir: str, ref: str) -> tuple[str, dict]:
    commit = _git(git_dir, "rev-parse", ref).strip()
    paths = [p for p in _git(git_dir, "ls-tree", "-r", "--name-only", commit, "--", "python/src").splitlines()
             if p.endswith(".cpp")]
    return commit, bindings([_git(git_dir, "show", f"{commit}:{p}") for p in paths])


def removed(old: dict, new: dict) -> dict:
    kept_names = set(new["functions"]) | set(new["classes"]) | {m for ms in new["members"].values() for m in ms}
    out: dict = {"classes": sorted(set(old["classes"]) - set(new["classes"])), "enum_members": {},
                 "members": {}, "members_still_bound_elsewhere": {}, "functions": sorted(old["functions"] -
                                                                                        new["functions"])}
    for name, kind in sorted(old["classes"].items()):
        if name not in new["classes"]:
            continue
        gone = sorted(old["members"].get(name, set()) - new["members"].get(name, set()))
        if not gone:
            continue
        if kind == "enum":
            out["enum_members"][name] = gone
        else:
            elsewhere = [m for m in gone if m in kept_names]
            if elsewhere:
                out["members_still_bound_elsewhere"][name] = elsewhere
            rest = [m for m in gone if m not in kept_names]
            if rest:
                out["members"][name] = rest
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--git-dir", required=True, help="a clone (or bare mirror) of github.com/NVIDIA/TensorRT")
    parser.add_argument("--old", default="release/10.13")
    parser.add_argument("--new", default="release/11.1")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    old_commit, old = read_release(args.git_dir, args.old)
    new_commit, new = read_release(args.git_dir, args.new)
    result = {
        "provenance": {
            "repository": "https://github.com/NVIDIA/TensorRT",
            "old": {"ref": args.old, "commit": old_commit}, "new": {"ref": args.new, "commit": new_commit},
            "sources": "python/src/**/*.cpp (pybind11 bindings of tensorrt and its ONNX parser)",
            "generated_by": "scripts/tensorrt_removed_api.py",
        },
        "counts": {"old_classes": len(old["classes"]), "new_classes": len(new["classes"])},
        **removed(old, new),
    }
    args.out.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    print(f"{args.out}: {len(result['classes'])} classes, {sum(map(len, result['enum_members'].values()))} enum "
          f"members, {sum(map(len, result['members'].values()))} members, {len(result['functions'])} functions removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
