"""Weights at refit time: their content hash, the cast to what the engine holds, and the full set one refit must
write so that nothing of an earlier refit survives."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import numpy as np

from ...errors import RefitError
from .dtypes import numpy_dtype_for


def weights_digest(weights: Mapping[str, np.ndarray]) -> str:
    """Content hash of refit weights (names, dtypes, shapes, values), independent of their order."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        array = np.ascontiguousarray(weights[name])
        digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.reshape(-1).view(np.uint8).tobytes())
    return digest.hexdigest()


def prepare_refit_weights(
    engine_name: str,
    prototypes: Mapping[str, tuple[str, int]],
    weights: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Cast each weight to the dtype the engine was built with and check its size.

    `prototypes` maps a weight name to (dtype name, element count) as TensorRT reports it; a count
    of -1 means the engine has no refittable weight of that name. One RefitError lists every problem.
    """
    prepared: dict[str, np.ndarray] = {}
    problems = []
    for name, array in weights.items():
        dtype_name, count = prototypes.get(name, ("", -1))
        target = numpy_dtype_for(dtype_name) if count >= 0 else None
        if count < 0:
            problems.append(f"{name}: the engine has no refittable weight of this name")
        elif target is None:
            problems.append(f"{name}: the engine holds it as {dtype_name}, which numpy cannot represent")
        elif np.size(array) != count:
            problems.append(f"{name}: {np.size(array)} values (shape {np.shape(array)}), the engine holds {count}")
        else:
            prepared[name] = np.ascontiguousarray(array, dtype=target)
    if problems:
        raise RefitError(f"cannot refit engine {engine_name}:\n  " + "\n  ".join(problems))
    return prepared


def check_finite_weights(engine_name: str, weights: Mapping[str, np.ndarray]) -> None:
    """RefitError naming the weights holding NaN or infinity: what TensorRT's `weights_validation` would refuse,
    checked once when a weight set is uploaded for device-resident swaps (which skip that validation)."""
    bad = sorted(name for name, array in weights.items()
                 if array.dtype.kind == "f" or array.dtype.name == "bfloat16"
                 if not np.isfinite(np.asarray(array, np.float32)).all())
    if bad:
        raise RefitError(f"cannot refit engine {engine_name}: weight(s) {bad[:5]} hold NaN or infinity")


def weights_for_refit(
    engine_name: str,
    refitted_before: Iterable[str],
    weights: Mapping[str, np.ndarray],
    base_weights: Mapping[str, np.ndarray] | None,
) -> dict[str, np.ndarray]:
    """The full set of weights one refit must write so that nothing of an earlier refit survives.

    Weights changed by an earlier refit (LoRA A) and absent from this one (LoRA B) go back to their
    base values in the same refit; without base weights that would leave A's residue, so it is refused.
    """
    stale = sorted(set(refitted_before) - set(weights))
    if not stale:
        return dict(weights)
    if base_weights is None:
        raise RefitError(
            f"cannot refit engine {engine_name}: {len(stale)} weight(s) changed by an earlier refit are not in this one "
            f"(e.g. {stale[:5]}); pass the base weights so they are restored, or the earlier LoRA leaves residue"
        )
    absent = [name for name in stale if name not in base_weights]
    if absent:
        raise RefitError(f"cannot refit engine {engine_name}: the base weights lack {absent[:10]}")
    return {**{name: base_weights[name] for name in stale}, **weights}
