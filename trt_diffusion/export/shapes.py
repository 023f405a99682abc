"""The shapes one export covers: its dynamic ranges, the geometry it traces, the geometries it is checked at.

Ranges span min..max of every bucket and batch of the group. A range with a single value is widened by
one step (one more batch, one more aligned latent row/column) so the graph is really dynamic, the
exporter never sees a size-1 example (torch.export specializes those), and parity runs at two shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..components.base import AXES, ComponentDef, ComponentIO, Geometry, SymbolicDim
from ..components.model_config import ModelConfig
from ..engines_file.engine_spec import Size
from ..errors import ExportError
from .grouping import ExportGroup


@dataclass(frozen=True)
class ExportShapes:
    ranges: dict[str, tuple[int, int]]  # axis -> (min, max) in axis units (batch, latent px, tokens)
    alignment: int  # latent height/width are multiples of this
    example: Geometry  # what the exporter traces (the max corner: every dynamic dim >= 2)
    parity: tuple[Geometry, ...]  # where ONNX Runtime is checked against PyTorch: min, opt, max corners
    pixels: tuple[Size, Size] | None = None  # smallest and largest image size covered

    def label(self) -> str:
        """e.g. 'batch 1-2, 64x64..128x128'"""
        low, high = self.ranges["batch"]
        text = f"batch {low}-{high}" if high > low else f"batch {low}"
        return text + (f", {self.pixels[0]}..{self.pixels[1]}" if self.pixels else "")

    def dim_ranges(self, io: ComponentIO) -> dict[str, tuple[int, int]]:
        """Every symbolic dim name of the graph -> (min, max)."""
        found: dict[str, tuple[int, int]] = {}
        for decl in (*io.inputs, *io.outputs):
            for dim in decl.dims:
                if isinstance(dim, SymbolicDim):
                    low, high = self.ranges[dim.axis]
                    found[dim.name] = (int(dim.scale * low), int(dim.scale * high))
        return found

    def to_json(self) -> dict:
        return {"axes": {k: list(v) for k, v in self.ranges.items()}, "alignment": self.alignment,
                "example": self.example.label(), "parity": [g.label() for g in self.parity], "label": self.label()}


def export_shapes(group: ExportGroup, definition: ComponentDef, config: ModelConfig) -> ExportShapes:
    shapes = [member for spec in group.specs for member in spec.members]  # every profile of a multi-profile spec
    batches = sorted({spec.batch for spec in shapes})
    batch_range = (batches[0], max(batches[-1], batches[0] + 1))
    if not definition.resolution_dependent:
        parity = tuple(dict.fromkeys([Geometry(batch_range[0]), Geometry(batches[-1]), Geometry(batch_range[1])]))
        return ExportShapes({"batch": batch_range}, 1, Geometry(batch_range[1]), parity)

    alignment = definition.spatial_alignment(config)
    factor = config.vae_scale_factor
    sizes = [size for spec in shapes for size in (spec.bucket.min, spec.bucket.opt, spec.bucket.max)]
    _check_alignment(group, sizes, factor, alignment)
    step = factor * alignment  # one aligned latent row, in pixels
    widths = _widened([s.width for s in sizes], step)
    heights = _widened([s.height for s in sizes], step)
    low = Geometry(batch_range[0], Size(widths[0], heights[0]))
    high = Geometry(batch_range[1], Size(widths[1], heights[1]))
    opts = [Geometry(spec.batch, spec.bucket.opt) for spec in shapes]
    opt = next((g for g in opts if g not in (low, high)), opts[0])  # a third shape where there is one
    ranges = {"batch": batch_range}
    for axis in AXES[1:]:
        ranges[axis] = (definition.axis_values(config, low)[axis], definition.axis_values(config, high)[axis])
    parity = tuple(dict.fromkeys([low, opt, high]))
    return ExportShapes(ranges, alignment, high, parity, pixels=(low.size, high.size))


def _widened(values: list[int], step: int) -> tuple[int, int]:
    low, high = min(values), max(values)
    return (low, high if high > low else low + step)


def _check_alignment(group: ExportGroup, sizes: list[Size], factor: int, alignment: int) -> None:
    step = factor * alignment
    bad = sorted({str(s) for s in sizes if s.width % step or s.height % step})
    if bad:
        raise ExportError(
            f"{group.name}: bucket size(s) {', '.join(bad)} are not multiples of {step} pixels; the "
            f"{group.component} needs latent sides that are multiples of {alignment} "
            f"({factor} pixels per latent pixel): use sizes that are multiples of {step}")
