"""ModelOpt post-training quantization of one torch module: config, calibration, saved state.

The only module that imports modelopt, and lazily: its import costs seconds. (The ONNX symbolics ModelOpt
registers for the legacy exporter come with the quantized modules themselves.)
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .. import progress as live
from ..errors import QuantizeError
from ..precision import Precision
from .defaults import CALIBRATION_PERCENTILE, SMOOTHQUANT_ALPHA
from .exclusions import LayerSelection
from .feeds import Call

log = logging.getLogger(__name__)

STATE_FORMAT = 1
FP8_E4M3_MAX = 448.0
_QUANTIZED_CLASSES = ("nn.Linear", "nn.Conv1d", "nn.Conv2d", "nn.Conv3d")  # as in exclusions.QUANTIZABLE_TYPES

_NUMERICS = {
    # weights per output channel for int8 (what TensorRT's int8 kernels take), per tensor for fp8
    Precision.int8: ({"num_bits": 8, "axis": 0}, {"num_bits": 8, "axis": None}),
    Precision.fp8: ({"num_bits": (4, 3), "axis": None}, {"num_bits": (4, 3), "axis": None}),
}


def modelopt_version() -> str:
    """From the package metadata: keys are computed without paying for modelopt's import."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-modelopt")
    except metadata.PackageNotFoundError:
        import modelopt

        return modelopt.__version__


@contextlib.contextmanager
def _modelopt_quiet():
    """ModelOpt prints progress to stdout; keep it in the debug log instead."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield
    if buffer.getvalue().strip():
        log.debug("modelopt: %s", buffer.getvalue().strip())


def _import_mtq():
    """modelopt.torch.quantization and .opt, imported the first time on a thread of their own.

    pulp (a ModelOpt dependency) keeps the exceptions its solver probes raise during import; their
    tracebacks reach, frame by frame, back to whoever imported it, so an import from the quantize stage
    would keep the stage's frames, and the full-size UNet in them, alive for the rest of the process. A
    thread's frames lead back to nothing of ours.
    """
    if "modelopt.torch.quantization" not in sys.modules:
        failure: list[BaseException] = []
        thread = threading.Thread(target=_import_modelopt, args=(failure,), name="import-modelopt")
        thread.start()
        thread.join()
        if failure:
            raise failure[0]
    import modelopt.torch.opt as mto
    import modelopt.torch.quantization as mtq

    return mtq, mto


def _tensor_quantizer_class():
    _import_mtq()
    from modelopt.torch.quantization.nn import TensorQuantizer

    return TensorQuantizer


def _import_modelopt(failure: list[BaseException]) -> None:
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
            import modelopt.torch.opt  # noqa: F401
            import modelopt.torch.quantization  # noqa: F401
    except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
        failure.append(exc)


def quantize_config(precision: str, algorithm: str, selection: LayerSelection) -> dict:
    """A ModelOpt config that quantizes exactly the selected layers (weights and inputs), nothing else.

    Everything starts disabled, so norms, attention matmuls and excluded layers stay in higher precision.
    """
    if precision not in _NUMERICS:
        raise QuantizeError(f"cannot quantize to {precision!r}: supported are {', '.join(_NUMERICS)}")
    if algorithm == "smoothquant" and precision != Precision.int8:
        raise QuantizeError(f"calibration algorithm 'smoothquant' applies to int8 only (asked for {precision}); "
                            "use 'max' or 'percentile' for fp8")
    weight_cfg, input_cfg = _NUMERICS[precision]
    if algorithm == "percentile":
        input_cfg = {**input_cfg, "calibrator": "histogram"}
    # A handful of class-scoped entries plus one per excluded layer: ModelOpt matches every entry against
    # every module, so one entry per quantized layer would cost minutes on a full-size UNet.
    entries: list[dict] = [{"quantizer_name": "*", "enable": False}]
    for class_name in _QUANTIZED_CLASSES:
        entries.append({"quantizer_name": "*weight_quantizer", "parent_class": class_name, "cfg": dict(weight_cfg)})
        entries.append({"quantizer_name": "*input_quantizer", "parent_class": class_name, "cfg": dict(input_cfg)})
    for name in selection.excluded:
        entries.append({"quantizer_name": f"{name}.*", "enable": False})
    methods = {"max": {"method": "max"}, "smoothquant": {"method": "smoothquant", "alpha": SMOOTHQUANT_ALPHA},
               "percentile": None}  # percentile: statistics are collected and reduced in `_percentile_calibrate`
    if algorithm not in methods:
        raise QuantizeError(f"unknown calibration algorithm {algorithm!r} (known: {', '.join(methods)})")
    return {"quant_cfg": entries, "algorithm": methods[algorithm]}


def replay(calls: Iterable[Call]) -> Callable[[torch.nn.Module], None]:
    """A ModelOpt forward loop that re-runs recorded denoiser calls, in order (the stage calibrates during
    the generations instead: `calibration.calibration_loop`)."""
    calls = list(calls)
    if not calls:
        raise QuantizeError("no calibration data: the pipeline never called the denoiser")

    def forward_loop(module: torch.nn.Module) -> None:
        # A line at most every 10 s: a full calibration is hundreds of calls.
        with torch.no_grad(), live.task("calibration", total=len(calls), min_interval_s=10.0) as lines:
            for index, (args, kwargs) in enumerate(calls):
                lines.step(index + 1, "denoiser call (ModelOpt statistics)")
                module(*args, **kwargs)

    return forward_loop


def calibrate(module: torch.nn.Module, precision: str, algorithm: str, selection: LayerSelection,
              forward_loop: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """Insert quantizers into `module` (in place) and calibrate them with `forward_loop(module)`, which runs
    the calibration data through it (ModelOpt may call it more than once: SmoothQuant does)."""
    mtq, _ = _import_mtq()
    config = quantize_config(precision, algorithm, selection)
    with _modelopt_quiet():
        if algorithm == "percentile":
            mtq.quantize(module, config, forward_loop=None)
            _percentile_calibrate(module, forward_loop)
        else:
            mtq.quantize(module, config, forward_loop=forward_loop)
    _check_selection(module, selection)
    return module


def _check_selection(module: torch.nn.Module, selection: LayerSelection) -> None:
    """The layers ModelOpt quantized are exactly the selected ones (a subclass it does not know would be missed)."""
    got, wanted = set(quantized_layers(module)), set(selection.quantized)
    if got != wanted:
        missing, extra = sorted(wanted - got), sorted(got - wanted)
        raise QuantizeError(f"ModelOpt quantized other layers than selected: missing {missing[:5]}, "
                            f"unexpected {extra[:5]}")


def _percentile_calibrate(module: torch.nn.Module, forward_loop) -> None:
    """Histogram statistics for inputs reduced at a percentile; weights keep max (their range is exact)."""
    TensorQuantizer = _tensor_quantizer_class()  # modelopt imported first, on its own thread
    from modelopt.torch.quantization.calib import HistogramCalibrator
    from modelopt.torch.quantization.model_calib import enable_stats_collection

    enable_stats_collection(module)
    forward_loop(module)
    for quantizer in module.modules():
        if not isinstance(quantizer, TensorQuantizer) or quantizer._disabled:
            continue
        if isinstance(getattr(quantizer, "_calibrator", None), HistogramCalibrator):
            quantizer.load_calib_amax("percentile", percentile=CALIBRATION_PERCENTILE)
        elif getattr(quantizer, "_calibrator", None) is not None:
            quantizer.load_calib_amax()
        quantizer.enable_quant()
        quantizer.disable_calib()


# --- what was quantized ------------------------------------------------------------------------

def enabled_quantizers(module: torch.nn.Module) -> list[str]:
    """Names of the quantizers that are on (e.g. 'down_blocks.0.resnets.0.conv1.input_quantizer')."""
    TensorQuantizer = _tensor_quantizer_class()

    return [name for name, q in module.named_modules() if isinstance(q, TensorQuantizer) and q.is_enabled]


def quantized_layers(module: torch.nn.Module) -> list[str]:
    """Layers whose weight quantizer is on."""
    suffix = ".weight_quantizer"
    return [n[: -len(suffix)] for n in enabled_quantizers(module) if n.endswith(suffix)]


def amax_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every enabled quantizer's calibrated range: what the Q/DQ scales are made of."""
    TensorQuantizer = _tensor_quantizer_class()

    result = {}
    for name, q in module.named_modules():
        if isinstance(q, TensorQuantizer) and q.is_enabled and q.amax is not None:
            result[name] = q.amax.detach().clone()
    return result


def weight_amax(module: torch.nn.Module, layer: str) -> torch.Tensor:
    return module.get_submodule(layer).weight_quantizer.amax.detach()


def check_calibrated(module: torch.nn.Module) -> None:
    """Every enabled quantizer has a finite, positive range (a quantizer no data reached has none)."""
    ranges = amax_tensors(module)
    bad = [name for name, amax in ranges.items() if not bool(torch.isfinite(amax).all()) or bool((amax <= 0).all())]
    missing = [name for name in enabled_quantizers(module) if name not in ranges]
    if bad or missing:
        names = ", ".join((bad + missing)[:5])
        raise QuantizeError(f"calibration left {len(bad) + len(missing)} quantizer(s) without a usable range "
                            f"({names}...): the calibration data never reached them")


# --- saved state: calibrate once, export as often as needed ------------------------------------

def _is_quantizer_key(key: str) -> bool:
    return "_quantizer." in key or key.endswith("_quantizer")


def save_state(module: torch.nn.Module, path: Path) -> None:
    """ModelOpt's state plus the calibrated tensors (amax, SmoothQuant's scales and smoothed weights)."""
    _, mto = _import_mtq()
    tensors = {k: v.detach().clone() for k, v in module.state_dict().items() if _is_quantizer_key(k)}
    smoothed = {}
    for name, layer in module.named_modules():
        quantizer = getattr(layer, "input_quantizer", None)
        if quantizer is not None and getattr(quantizer, "pre_quant_scale", None) is not None:
            smoothed[f"{name}.weight"] = layer.weight.detach().clone()  # SmoothQuant rescaled it
    torch.save({"format": STATE_FORMAT, "modelopt_version": modelopt_version(),
                "modelopt_state": mto.modelopt_state(module), "tensors": tensors, "smoothed_weights": smoothed},
               path)


def restore_state(module: torch.nn.Module, path: Path) -> torch.nn.Module:
    """Put a saved calibration back onto a freshly loaded (and LoRA-fused) fp32 module, in place."""
    _, mto = _import_mtq()
    try:
        # weights_only: tensors, dtypes and plain containers, never code. Whoever can write the workspace (a
        # restored cache, a shared volume) must not get to run a pickle's code here.
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a truncated, foreign or code-carrying file: recalibrate instead
        raise QuantizeError(f"{path}: unreadable calibration state ({exc})") from None
    if not isinstance(saved, dict):
        raise QuantizeError(f"{path}: not a calibration state")
    if saved.get("format") != STATE_FORMAT or saved.get("modelopt_version") != modelopt_version():
        raise QuantizeError(f"{path}: saved by another version (format {saved.get('format')}, "
                            f"modelopt {saved.get('modelopt_version')})")
    import warnings

    with _modelopt_quiet(), warnings.catch_warnings():
        # ModelOpt cannot tell the device of quantizers that hold no tensors (the disabled ones): harmless on CPU
        warnings.filterwarnings("ignore", message=".*Could not identify the device.*")
        mto.restore_from_modelopt_state(module, saved["modelopt_state"])
    state = dict(saved["tensors"])
    state.update(saved["smoothed_weights"])
    result = module.load_state_dict(state, strict=False)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if _is_quantizer_key(k)]
    if unexpected or missing:
        raise QuantizeError(f"{path}: calibration state does not fit this model "
                            f"({len(unexpected)} unexpected, {len(missing)} missing tensors)")
    return module
