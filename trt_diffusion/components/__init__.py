"""One declaration per component kind: I/O names and dtypes, symbolic dims, dummy inputs, the export
wrapper, and the (min, opt, max) shapes an engine spec implies."""

from .base import (
    ComponentDef,
    ComponentIO,
    ExportWrapper,
    Geometry,
    ProfileShapes,
    Shape,
    SymbolicDim,
    TensorDecl,
)
from .model_config import ModelConfig, load_model_config
from .registry import get_component, registered_components
from .unet import MID_RESIDUAL, down_residual_name, residual_layout

__all__ = [
    "MID_RESIDUAL", "ComponentDef", "ComponentIO", "ExportWrapper", "Geometry", "ModelConfig", "ProfileShapes",
    "Shape", "SymbolicDim", "TensorDecl", "down_residual_name", "get_component", "load_model_config",
    "registered_components", "residual_layout",
]
