"""torch -> ONNX: one verified graph per export group, kept in the artifact store."""

from ..engines_file.selection import select_specs  # re-exported: export selects specs as build does
from .grouping import ExportGroup, export_group_key, group_specs, onnx_precision
from .parity import TOLERANCES, OutputParity, Tolerance, check_parity
from .stage import ARTIFACT_KIND, ExportEvent, ExportReport, ExportResult, export_group

__all__ = [
    "ARTIFACT_KIND", "TOLERANCES", "ExportEvent", "ExportGroup", "ExportReport", "ExportResult", "OutputParity",
    "Tolerance", "check_parity", "export_group", "export_group_key", "group_specs", "onnx_precision", "select_specs",
]
