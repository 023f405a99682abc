"""torch -> ONNX: one verified graph per export group, kept in the artifact store.

The grouping and the results import no torch; the stage and the parity check (torch) are imported on first use,
so a no-op export (export_state.py) answers without them."""

import importlib

from ..engines_file.selection import select_specs  # re-exported: export selects specs as build does
from .grouping import ExportGroup, export_group_key, group_specs, onnx_precision
from .results import ExportEvent, ExportReport, ExportResult

_LAZY = {"TOLERANCES": "parity", "OutputParity": "parity", "Tolerance": "parity", "check_parity": "parity",
         "ARTIFACT_KIND": "stage", "export_group": "stage"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ARTIFACT_KIND", "TOLERANCES", "ExportEvent", "ExportGroup", "ExportReport", "ExportResult", "OutputParity",
    "Tolerance", "check_parity", "export_group", "export_group_key", "group_specs", "onnx_precision", "select_specs",
]
