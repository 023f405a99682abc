"""Refit maps: which ONNX initializer holds each torch parameter, and whether it is stored transposed.

Three ways to find it, tried in order for each parameter:
1. by name: `torch.onnx.export(dynamo=True, optimize=False)` keeps every parameter's name, possibly
   behind a constant prefix (`unet.` when the export wrapper holds the model as `self.unet`);
2. by the consuming node: optimized and legacy exports store Linear weights pre-transposed under
   made-up names (`val_164`, `onnx::MatMul_1624`); the MatMul/Gemm/Conv exported from the parameter's
   module (node metadata or node name) tells which initializer it reads;
3. by value, as a last resort: the one initializer equal to W or W.T exactly.
With torch values at hand every match is confirmed by value, so a map never points at the wrong tensor.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch

from ..errors import RefitError
from ..onnx_facts import onnx_sha256
from ..workspace.files import atomic_write_bytes
from .deltas import base_parameter_name
from .onnx_graph import OnnxGraph
from .quantized_refit import annotate_quantized
from .refit_records import MatchedBy, RefitTarget, Shape, WeightQuantization

REFIT_MAP_SCHEMA_VERSION = 1
REFIT_MAP_FILE = "refit_map.json"

ParamSpecs = torch.nn.Module | Mapping[str, torch.Tensor] | Mapping[str, Sequence[int]]


@dataclass
class RefitMap:
    onnx_sha256: str
    targets: dict[str, RefitTarget]
    unmapped: dict[str, str] = field(default_factory=dict)  # parameter -> why no initializer was found
    prefix: str = ""
    onnx_file: str = ""
    schema_version: int = REFIT_MAP_SCHEMA_VERSION

    def shared_initializers(self) -> dict[str, list[str]]:
        """Initializers that hold more than one parameter (exporters deduplicate identical tensors)."""
        holders: dict[str, list[str]] = {}
        for param, target in self.targets.items():
            holders.setdefault(target.initializer, []).append(param)
        return {name: sorted(params) for name, params in holders.items() if len(params) > 1}

    def check_onnx_sha256(self, sha256: str, what: str = "this ONNX") -> None:
        if sha256 != self.onnx_sha256:
            raise RefitError(
                f"the refit map was built for another ONNX ({self.onnx_file or '?'}, sha256 "
                f"{self.onnx_sha256[:16]}...) than {what} (sha256 {sha256[:16]}...); rebuild it with build_refit_map"
            )

    def check_onnx(self, onnx_path: str | Path) -> None:
        """Refuse an ONNX other than the one the map was built for (RefitError)."""
        self.check_onnx_sha256(onnx_sha256(onnx_path, error=RefitError), str(onnx_path))

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "onnx_file": self.onnx_file,
            "onnx_sha256": self.onnx_sha256,
            "prefix": self.prefix,
            "targets": {
                param: {**asdict(t), "shape": list(t.shape), "matched_by": t.matched_by.value,
                        "quantization": t.quantization.to_json() if t.quantization else None}
                for param, t in sorted(self.targets.items())
            },
            "unmapped": dict(sorted(self.unmapped.items())),
        }

    @classmethod
    def from_json(cls, data: dict, source: str = "refit map") -> RefitMap:
        version = data.get("schema_version") if isinstance(data, dict) else None
        if version != REFIT_MAP_SCHEMA_VERSION:
            raise RefitError(f"{source}: schema_version {version!r}, this tool reads {REFIT_MAP_SCHEMA_VERSION}; "
                             "rebuild the map with build_refit_map")
        try:
            targets = {
                param: RefitTarget(initializer=t["initializer"], transpose=bool(t["transpose"]),
                                   shape=tuple(int(d) for d in t["shape"]), dtype=str(t["dtype"]),
                                   matched_by=MatchedBy(t["matched_by"]),
                                   quantization=WeightQuantization.from_json(t["quantization"])
                                   if t.get("quantization") else None)
                for param, t in data["targets"].items()
            }
            return cls(onnx_sha256=str(data["onnx_sha256"]), targets=targets, unmapped=dict(data.get("unmapped", {})),
                       prefix=str(data.get("prefix", "")), onnx_file=str(data.get("onnx_file", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RefitError(f"{source} is malformed ({type(exc).__name__}: {exc}); rebuild it") from None

    def save(self, path: str | Path) -> Path:
        """Write as JSON (to `<path>/refit_map.json` when `path` is a folder), atomically."""
        path = Path(path)
        if path.is_dir():
            path = path / REFIT_MAP_FILE
        atomic_write_bytes(path, json.dumps(self.to_json(), indent=1).encode())
        return path

    @classmethod
    def load(cls, path: str | Path, onnx_path: str | Path | None = None) -> RefitMap:
        """Read a map (a file, or a folder holding refit_map.json); with `onnx_path`, refuse a map built
        for another ONNX."""
        path = Path(path)
        if path.is_dir():
            path = path / REFIT_MAP_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise RefitError(f"refit map {path} does not exist; build it with build_refit_map") from None
        except json.JSONDecodeError as exc:
            raise RefitError(f"refit map {path} is not valid JSON ({exc})") from None
        refit_map = cls.from_json(data, str(path))
        if onnx_path is not None:
            refit_map.check_onnx(onnx_path)
        return refit_map


# ----------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Param:
    shape: Shape
    value: np.ndarray | None  # fp32 values when known (confirms every match); None: shapes only


def _param_specs(params: ParamSpecs) -> dict[str, _Param]:
    items = params.named_parameters() if isinstance(params, torch.nn.Module) else params.items()
    specs = {}
    for name, item in items:
        if ".lora_" in name:
            continue
        if isinstance(item, torch.Tensor):
            value = None if item.is_meta else item.detach().cpu().float().numpy()
            specs[base_parameter_name(name)] = _Param(tuple(item.shape), value)
        else:
            specs[base_parameter_name(name)] = _Param(tuple(int(d) for d in item), None)
    return specs


def _common_prefix(names: list[str], wanted: set[str]) -> str:
    """The prefix most names carry in front of a wanted name (`unet.` + `conv_in.weight`), "" if none."""
    counts: Counter = Counter()
    for name in names:
        start = 0
        while start != -1:
            if name[start:] in wanted:
                counts[name[:start]] += 1
                break
            start = name.find(".", start) + 1 or -1
    return counts.most_common(1)[0][0] if counts else ""


def _expected_transpose(node: onnx.NodeProto, index: int) -> bool | None:
    """Whether a Linear weight read by this node input is stored as W.T (None: not a weight input)."""
    if node.op_type == "MatMul" and index == 1:
        return True
    if node.op_type == "Gemm" and index == 1:
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return not trans_b
    if node.op_type in ("Conv", "ConvTranspose") and index in (1, 2):
        return False
    return None


class _MapBuilder:
    def __init__(self, graph: OnnxGraph, params: dict[str, _Param]):
        self.graph = graph
        self.params = params
        self.targets: dict[str, RefitTarget] = {}
        self.unmapped: dict[str, str] = {}
        self.claimed: set[str] = set()
        self.init_by_plain_name = {base_parameter_name(n): n for n in graph.initializers}
        self.prefix = _common_prefix(list(self.init_by_plain_name), set(params))

    def _relation(self, param: str, init: str, expected: bool | None = None, cache: bool = False) -> bool | None:
        """transpose flag if `init` holds `param` (as W, W.T or W reshaped), else None."""
        spec, shape = self.params[param], self.graph.shape(init)
        if not self.graph.is_float(init) or int(np.prod(shape)) != int(np.prod(spec.shape)):
            return None
        transposable = len(spec.shape) == 2 and shape == spec.shape[::-1]
        if spec.value is None:  # shapes only: the consuming op decides between W and W.T
            if shape == spec.shape and not (transposable and expected):
                return False
            return True if transposable else None
        stored = self.graph.value(init, cache=cache)
        orientations = [True, False] if expected else [False, True]
        for transpose in orientations:
            if transpose and not transposable:
                continue
            candidate = spec.value.T if transpose else spec.value
            if np.array_equal(stored.reshape(-1), candidate.astype(stored.dtype).reshape(-1)):
                return transpose
        return None

    def _add(self, param: str, init: str, transpose: bool, how: MatchedBy) -> None:
        self.targets[param] = RefitTarget(initializer=init, transpose=transpose, shape=self.graph.shape(init),
                                          dtype=self.graph.dtype(init).name, matched_by=how)
        self.claimed.add(init)
        self.unmapped.pop(param, None)

    def by_name(self) -> None:
        for param in self.params:
            init = self.init_by_plain_name.get(self.prefix + param) or self.init_by_plain_name.get(param)
            if init is None:
                continue
            transpose = self._relation(param, init)
            if transpose is not None:
                self._add(param, init, transpose, MatchedBy.name)
            else:  # kept unless a later step finds it elsewhere
                self.unmapped[param] = (f"the initializer {init} holds other values or another shape "
                                        "(is this the model that was exported?)")

    def by_node(self) -> None:
        scopes = self.graph.nodes_by_scope
        if not scopes:
            return
        modules = {param.rpartition(".")[0] for param in self.params if param not in self.targets}
        scope_prefix = _common_prefix(list(scopes), modules)
        for param in [p for p in self.params if p not in self.targets]:
            module = param.rpartition(".")[0]
            found: dict[str, bool] = {}
            for scope in dict.fromkeys([scope_prefix + module, self.prefix + module, module]):
                for node in scopes.get(scope, []):
                    for index, init in self.graph.weight_inputs(node):
                        if init in self.claimed:
                            continue
                        transpose = self._relation(param, init, _expected_transpose(node, index))
                        if transpose is not None:
                            found[init] = transpose
            if len(found) == 1:
                init, transpose = next(iter(found.items()))
                self._add(param, init, transpose, MatchedBy.node)
            elif len(found) > 1:
                self.unmapped[param] = f"ambiguous: nodes of its module read {sorted(found)}"

    def by_value(self) -> None:
        pending = [p for p in self.params if p not in self.targets and self.params[p].value is not None]
        if not pending:
            return
        by_numel: dict[int, list[str]] = {}
        for init in self.graph.initializers:
            if self.graph.is_float(init):
                by_numel.setdefault(int(np.prod(self.graph.shape(init))), []).append(init)
        for param in pending:
            candidates = by_numel.get(int(np.prod(self.params[param].shape)), [])
            found = {init: t for init in candidates if (t := self._relation(param, init, cache=True)) is not None}
            free = {init: t for init, t in found.items() if init not in self.claimed}
            # an initializer already mapped may be shared: exporters deduplicate identical tensors
            choice = free if free else found
            if len(choice) == 1:
                init, transpose = next(iter(choice.items()))
                self._add(param, init, transpose, MatchedBy.value)
            elif len(choice) > 1:
                listed = sorted(choice)[:3]
                self.unmapped[param] = f"ambiguous: {len(choice)} initializers hold identical values ({listed})"

    def finish(self, unused: frozenset[str] = frozenset()) -> None:
        for param in self.params:
            if param not in self.targets and param not in self.unmapped:
                self.unmapped[param] = UNUSED_BY_GRAPH if param in unused else (
                    "no initializer holds it (unused by the export, or folded into another constant)")


# A parameter the graph never reads by design (a step cache's piece holds only part of its denoiser): a refit
# leaves it out silently where any other unmapped parameter is refused.
UNUSED_BY_GRAPH = "unused by this graph (a part of its model: a step cache's piece)"


def build_refit_map(onnx_path: str | Path, params: ParamSpecs, *, by_value: bool = True,
                    unused: frozenset[str] = frozenset()) -> RefitMap:
    """Map each torch parameter (a module, its state dict, or names -> shapes) to its ONNX initializer.

    With tensors every match is confirmed by value; with shapes only, name and node matches stand on
    shapes and op semantics, and the by-value fallback is skipped. Parameters no initializer holds are
    listed in `unmapped` with the reason; refitting one of them is refused later.
    """
    graph = OnnxGraph(onnx_path)
    builder = _MapBuilder(graph, _param_specs(params))
    builder.by_name()
    builder.by_node()
    if by_value:
        builder.by_value()
    annotate_quantized(graph, builder.targets, builder.unmapped, builder.params, builder.prefix)
    builder.finish(unused)
    return RefitMap(onnx_sha256=onnx_sha256(onnx_path, error=RefitError), targets=builder.targets,
                    unmapped=builder.unmapped, prefix=builder.prefix, onnx_file=Path(onnx_path).name)
