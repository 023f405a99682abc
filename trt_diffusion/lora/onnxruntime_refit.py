"""LoRA on the onnxruntime target without re-export: sessions whose initializers are replaced.

`SessionOptions.add_external_initializers` replaces initializers before graph optimization, so a
refit costs one session creation with every optimization intact, and every session starts from the
untouched base ONNX: switching A -> B -> A cannot leave residue of B, and restoring the base is a
session with no replacements. Only external-data initializers can be replaced (see `refit_base`);
`add_initializer` is not used because onnxruntime applies it after folding and silently loses it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import RefitError
from .deltas import LoraWithScale, lora_deltas
from .files import LoraFile
from .refit_base import inline_initializers
from .refit_map import RefitMap
from .refit_weights import refit_arrays

SessionOptionsFactory = Callable[[], Any]  # () -> onnxruntime.SessionOptions, fresh for each session
DEFAULT_PROVIDERS = ("CPUExecutionProvider",)
_KEEPALIVE_ATTRIBUTE = "_trt_diffusion_refit_buffers"


def _check_replaceable(onnx_path: str | Path, names: Sequence[str]) -> None:
    inline = inline_initializers(onnx_path, list(names))
    if inline:
        raise RefitError(
            f"{onnx_path}: {len(inline)} weight(s) to refit are stored inside the .onnx file ({inline[:5]}); "
            "onnxruntime can only replace external-data weights before it optimizes (it would silently keep the old "
            "values). Rewrite the base once with trt_diffusion.lora.externalize_weights and build the refit map for it"
        )


def _ortvalue(ort, array: np.ndarray):
    """An OrtValue over `array`'s buffer; float8 (ml_dtypes, which numpy does not know) by its ONNX type."""
    if array.dtype.name == "float8_e4m3fn":
        import onnx

        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint8),
                                                               onnx.TensorProto.FLOAT8E4M3FN)
    return ort.OrtValue.ortvalue_from_numpy(array)


def onnxruntime_session(
    onnx_path: str | Path,
    replacements: Mapping[str, np.ndarray] | None = None,
    *,
    providers: Sequence[str] | None = None,
    session_options: SessionOptionsFactory | None = None,
) -> Any:
    """A session on the ONNX file with the given initializers replaced (none: the base weights)."""
    import onnxruntime as ort

    replacements = replacements or {}
    if replacements:
        _check_replaceable(onnx_path, list(replacements))
    options = session_options() if session_options is not None else ort.SessionOptions()
    # ORT reads the replacement buffers in place for the session's whole life (freeing them early
    # crashes the process): the arrays and OrtValues stay referenced from the session itself
    # (np.require, not ascontiguousarray: that makes a 0-d array, a per-tensor scale, 1-d)
    buffers = {name: np.require(array, requirements="C") for name, array in replacements.items()}
    values = {name: _ortvalue(ort, array) for name, array in buffers.items()}
    if values:
        options.add_external_initializers(list(values), list(values.values()))
    try:
        session = ort.InferenceSession(str(onnx_path), sess_options=options,
                                       providers=list(providers or DEFAULT_PROVIDERS))
    except Exception as exc:  # noqa: BLE001 - ORT raises its own types (Fail, InvalidArgument, ...) for a bad replacement
        raise RefitError(f"onnxruntime refused the refitted weights for {onnx_path}: {exc}") from None
    setattr(session, _KEEPALIVE_ATTRIBUTE, (buffers, values, options))
    return session


def apply_refit_onnxruntime(
    onnx_path: str | Path,
    refit_map: RefitMap,
    weights: Mapping[str, torch.Tensor | np.ndarray],
    *,
    providers: Sequence[str] | None = None,
    session_options: SessionOptionsFactory | None = None,
    check_onnx: bool = True,
) -> Any:
    """A session on the base ONNX with `weights` (torch parameter name -> fused value, as `lora_deltas`
    gives) written into their initializers. Refuses a map built for another ONNX, and weights stored
    inside the .onnx file (see `externalize_weights`)."""
    if check_onnx:
        refit_map.check_onnx(onnx_path)
    overrides = refit_arrays(refit_map, weights)
    return onnxruntime_session(onnx_path, overrides, providers=providers, session_options=session_options)


def restore_base(
    onnx_path: str | Path,
    *,
    providers: Sequence[str] | None = None,
    session_options: SessionOptionsFactory | None = None,
) -> Any:
    """The base model again: a session with no replacements."""
    return onnxruntime_session(onnx_path, providers=providers, session_options=session_options)


def _lora_key(source: Any, scale: float) -> tuple[str, float]:
    return (str(source.path) if isinstance(source, LoraFile) else str(source), float(scale))


class OnnxRuntimeRefitter:
    """The onnxruntime target's LoRA state: base session, current LoRA set, switching between sets.

    Every switch computes the fused weights from the base model's weights (never from the current
    ones) and creates a session from the base ONNX, so A -> B -> A is bit-identical to A, and a set
    whose scales are all 0 is the base session itself. A failed switch leaves the current session.
    """

    def __init__(
        self,
        onnx_path: str | Path,
        refit_map: RefitMap,
        base_model: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        component: str | None = None,
        providers: Sequence[str] | None = None,
        session_options: SessionOptionsFactory | None = None,
    ):
        refit_map.check_onnx(onnx_path)
        self.onnx_path = Path(onnx_path)
        self.refit_map = refit_map
        self.base_model = base_model
        self.component = component
        self.providers = providers
        self.session_options = session_options
        self._base_session: Any = None
        self.session: Any = None
        self.loras: tuple[tuple[str, float], ...] = ()

    @property
    def base_session(self) -> Any:
        if self._base_session is None:
            self._base_session = restore_base(self.onnx_path, providers=self.providers,
                                              session_options=self.session_options)
        return self._base_session

    def apply(self, loras: Sequence[LoraWithScale]) -> Any:
        """Switch to exactly this LoRA set (empty: the base) and return the session to run."""
        loras = list(loras)
        weights = lora_deltas(self.base_model, loras, component=self.component)
        if weights:
            session = apply_refit_onnxruntime(self.onnx_path, self.refit_map, weights, providers=self.providers,
                                              session_options=self.session_options, check_onnx=False)
        else:
            session = self.base_session
        self.session = session
        self.loras = tuple(_lora_key(source, scale) for source, scale in loras)
        return session

    def restore_base(self) -> Any:
        self.session, self.loras = self.base_session, ()
        return self.session
