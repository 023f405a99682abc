"""engines.yaml: schema, loading with file:line errors, and expansion into EngineSpecs. No torch here."""

from .engine_spec import Bucket, EngineSpec, LoraVariant, Size
from .expand import denoiser_batches, expand
from .load import EnginesConfig, ResolvedModel, load_engines_file
from .schema import CfgMode, LoraMode, Precision, Target

__all__ = [
    "Bucket", "CfgMode", "EngineSpec", "EnginesConfig", "LoraMode", "LoraVariant", "Precision", "ResolvedModel",
    "Size", "Target", "denoiser_batches", "expand", "load_engines_file",
]
