"""The shapes one export covers: its dynamic ranges, the geometry it traces, the geometries it is checked at.

Ranges span min..max of every bucket and batch of the group. A range with a single value is widened by
one step (one more batch, one more aligned latent row/column, one more latent frame) so the graph is really
dynamic, the exporter never sees a size-1 example (torch.export specializes those), and parity runs at two shapes.

A group whose graph fixes its frame count (grouping.frame_counts: a whole-clip video VAE decoder) is exported at
that count: its frames axis is `fixed`, and the graph's I/O says the count instead of a dim name (`graph_io`).

Where checking at the bucket's corners would not fit in memory — a component whose one attention score tensor
(`ComponentDef.attention_score_bytes`) passes CHECK_SCORE_BYTES there: a 1.3B Wan transformer at 480p × 17 frames,
2 × 9,858 tokens, has 9.3 GB scores per tensor — the export traces and checks the same dynamic graph at smaller
shapes instead (`_checkable`): the fewest latent frames that stay dynamic and sides halved until the scores fit,
each corner widened by one step as above. Every dim is symbolic (and checked so by graph_passes), so the
arithmetic checked there is the bucket's; the engines are still built for the bucket, and `parity` judges them
there, in images.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..components.base import AXES, TEXT_AXIS, ComponentDef, ComponentIO, Geometry, SymbolicDim, TensorDecl
from ..components.model_config import ModelConfig
from ..engines_file.engine_spec import Size
from ..errors import ExportError
from ..families import family_info
from .grouping import ExportGroup


@dataclass(frozen=True)
class ExportShapes:
    ranges: dict[str, tuple[int, int]]  # axis -> (min, max) in axis units (batch, latent px, tokens)
    alignment: int  # latent height/width are multiples of this
    example: Geometry  # what the exporter traces (the max corner: every dynamic dim >= 2)
    parity: tuple[Geometry, ...]  # where ONNX Runtime is checked against PyTorch: min, opt, max corners
    pixels: tuple[Size, Size] | None = None  # smallest and largest image size covered
    fixed: dict[str, int] = field(default_factory=dict)  # axis -> its one value, where the graph cannot vary it
    smaller_check: str | None = None  # why the trace and check run below the bucket's shapes (see the docstring)

    def label(self) -> str:
        """e.g. 'batch 1-2, 64x64..128x128' (', text 2-512' where the text length is dynamic)"""
        low, high = self.ranges["batch"]
        text = f"batch {low}-{high}" if high > low else f"batch {low}"
        if TEXT_AXIS in self.ranges:
            text += ", text {}-{}".format(*self.ranges[TEXT_AXIS])
        return text + (f", {self.pixels[0]}..{self.pixels[1]}" if self.pixels else "")

    def dim_ranges(self, io: ComponentIO) -> dict[str, tuple[int, int]]:
        """Every symbolic dim name of the graph -> (min, max) (pass `graph_io`'s I/O: fixed axes are no dims)."""
        found: dict[str, tuple[int, int]] = {}
        for decl in (*io.inputs, *io.outputs):
            for dim in decl.dims:
                if isinstance(dim, SymbolicDim):
                    low, high = self.ranges[dim.axis]
                    found[dim.name] = (_size(dim, low), _size(dim, high))
        return found

    def graph_io(self, io: ComponentIO) -> ComponentIO:
        """The declared I/O as this export's graph has it: every dim of a fixed axis is its size."""
        if not self.fixed:
            return io

        def fix(decl: TensorDecl) -> TensorDecl:
            dims = tuple(_size(d, self.fixed[d.axis]) if isinstance(d, SymbolicDim) and d.axis in self.fixed else d
                         for d in decl.dims)
            return replace(decl, dims=dims)

        return replace(io, inputs=tuple(map(fix, io.inputs)), outputs=tuple(map(fix, io.outputs)))

    def to_json(self) -> dict:
        data = {"axes": {k: list(v) for k, v in self.ranges.items()}, "alignment": self.alignment,
                "example": self.example.label(), "parity": [g.label() for g in self.parity], "label": self.label()}
        if self.fixed:  # absent for image families: their export hashes are unchanged
            data["fixed"] = dict(self.fixed)
        if self.smaller_check:  # absent where the check runs at the bucket's corners
            data["smaller_check"] = self.smaller_check
        return data


def _size(dim: SymbolicDim, axis_value: int) -> int:
    return int(dim.scale * axis_value + dim.offset)


def export_shapes(group: ExportGroup, definition: ComponentDef, config: ModelConfig) -> ExportShapes:
    shapes = _fixed_text_shapes(group, definition, config)
    lengths = definition.text_lengths(config, group.options)
    return shapes if lengths is None else _with_text(shapes, lengths)


def _with_text(shapes: ExportShapes, lengths: tuple[int, int, int]) -> ExportShapes:
    """A dynamic text length (Qwen-Image's encoder and transformer): its range beside the others, traced at its max,
    checked at min with the low corner, opt with the middle one and max with the high corner."""
    low, opt, high = lengths
    if high <= low:
        high = low + 1  # one more token: really dynamic, as the other widened ranges
    corners = shapes.parity  # low, (opt,) high: each text length is checked, opt with the middle (or high) one
    parity = [replace(corners[0], text=low), replace(corners[len(corners) // 2], text=min(max(opt, low), high)),
              replace(corners[-1], text=high)]
    return replace(shapes, ranges={**shapes.ranges, TEXT_AXIS: (low, high)}, example=replace(shapes.example, text=high),
                   parity=tuple(dict.fromkeys(parity)))


def _fixed_text_shapes(group: ExportGroup, definition: ComponentDef, config: ModelConfig) -> ExportShapes:
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
    frames = _frame_range(group, [s.frames for s in sizes])
    low = Geometry(batch_range[0], Size(widths[0], heights[0], frames[0]))
    high = Geometry(batch_range[1], Size(widths[1], heights[1], frames[1]))
    opts = [Geometry(spec.batch, spec.bucket.opt) for spec in shapes]
    opt = next((g for g in opts if g not in (low, high)), opts[0])  # a third shape where there is one
    ranges = {"batch": batch_range}
    for axis in AXES[1:]:
        ranges[axis] = (definition.axis_values(config, low)[axis], definition.axis_values(config, high)[axis])
    fixed = {"frames": ranges["frames"][0]} if group.frames else {}
    parity = tuple(dict.fromkeys([low, opt, high]))
    shapes = ExportShapes(ranges, alignment, high, parity, pixels=(low.size, high.size), fixed=fixed)
    return _checkable(shapes, definition, config, step, 0 if group.frames else family_info(group.family).temporal_factor)


CHECK_SCORE_BYTES = 64 << 20
"""The largest attention score tensor the export check may materialize. ONNX Runtime runs the exported attention
unfused and keeps about a dozen score-sized tensors alive: measured on the 1.3B Wan transformer, 2.18 GiB above its
weights at batch 2 × 1,296 tokens (161 MB per score tensor) and 0.64 GiB at batch 1 × 780 (29 MB). At 64 MiB the
check stays under a GiB above the weights."""


def _checkable(shapes: ExportShapes, definition: ComponentDef, config: ModelConfig, step: int,
               temporal: int) -> ExportShapes:
    """`shapes`, or the same export traced and checked at smaller shapes where the bucket's scores pass the budget."""
    def scores(geometry: Geometry) -> int:
        return definition.attention_score_bytes(config, geometry) or 0

    worst = max(shapes.parity, key=scores)
    if scores(worst) <= CHECK_SCORE_BYTES:
        return shapes
    low_corner = shapes.parity[0]
    frames = min(low_corner.size.frames, 1 + temporal) if temporal else low_corner.size.frames  # 2 latent frames
    width, height = low_corner.size.width, low_corner.size.height

    def corners(width: int, height: int) -> tuple[Geometry, Geometry]:
        low = Geometry(low_corner.batch, Size(width, height, frames))
        return low, Geometry(shapes.example.batch, Size(width + step, height + step, frames + temporal))

    low, high = corners(width, height)
    while scores(high) > CHECK_SCORE_BYTES and (width > 2 * step or height > 2 * step):
        width, height = (max(2 * step, side // 2 // step * step) for side in (width, height))
        low, high = corners(width, height)
    ranges = dict(shapes.ranges)
    for axis in AXES[1:]:  # the export's dims span the bucket and the checked shapes
        low_value, high_value = definition.axis_values(config, low)[axis], definition.axis_values(config, high)[axis]
        ranges[axis] = (min(ranges[axis][0], low_value), max(ranges[axis][1], high_value))
    why = (f"checked at {low.label()} and {high.label()}: at {worst.label()} one attention score tensor is "
           f"{scores(worst) / 2**30:.1f} GiB (budget {CHECK_SCORE_BYTES >> 20} MiB)")
    return replace(shapes, ranges=ranges, example=high, parity=(low, high), smaller_check=why)


def _widened(values: list[int], step: int) -> tuple[int, int]:
    low, high = min(values), max(values)
    return (low, high if high > low else low + step)


def _frame_range(group: ExportGroup, counts: list[int]) -> tuple[int, int]:
    """Pixel frames (min, max): 0 for images; one count for a graph that fixes it; else a range, widened by one
    latent frame (the VAE's temporal factor in frames) when the group has one count."""
    temporal = family_info(group.family).temporal_factor
    if not temporal:
        return (0, 0)
    if group.frames is None:
        return _widened(counts, temporal)
    if len(group.frames) > 1:
        raise ExportError(
            f"{group.name}: the bucket spans {group.frames[0]}..{group.frames[-1]} frames, but the {group.family} "
            f"{group.component} decodes the whole clip in one graph whose frame count is fixed (the exporter unrolls "
            f"its causal cache over the latent frames): give it one bucket per frame count "
            f"({', '.join(map(str, range(group.frames[0], group.frames[-1] + 1, temporal)))})")
    return (group.frames[0], group.frames[0])


def _check_alignment(group: ExportGroup, sizes: list[Size], factor: int, alignment: int) -> None:
    step = factor * alignment
    bad = sorted({str(s) for s in sizes if s.width % step or s.height % step})
    if bad:
        raise ExportError(
            f"{group.name}: bucket size(s) {', '.join(bad)} are not multiples of {step} pixels; the "
            f"{group.component} needs latent sides that are multiples of {alignment} "
            f"({factor} pixels per latent pixel): use sizes that are multiples of {step}")
