"""Pickle-free state trees: nested JSON containers whose tensors live in a separate flat mapping.

:func:`split_tensors` turns a state (dicts, lists, tuples, scalars, tensors, small numpy arrays) into a JSON tree plus
a ``{key: tensor}`` mapping that safetensors can store; :func:`join_tensors` inverts it exactly. Checkpoints
(``rlpost.engine.checkpoint``) store component and plugin state this way, and the plugin host refuses plugin state
that it cannot hold (``rlpost.core.plugin_errors.check_saveable``) before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

__all__ = ["join_tensors", "split_tensors"]

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_ITEMS = "__items__"
_NDARRAY = "__ndarray__"  # a dict with non-string keys (torch optimizer state is keyed by int)


def split_tensors(obj: Any, tensors: dict[str, Tensor], prefix: str = "t") -> Any:
    """Return a JSON-serialisable copy of ``obj`` with every tensor moved into ``tensors``.

    Dicts with non-string keys (torch optimizer ``state`` is keyed by parameter index) and tuples are tagged so
    :func:`join_tensors` restores them exactly.

    Raises:
        TypeError: For values that are neither JSON scalars, containers nor tensors (we refuse to pickle them).
    """
    if isinstance(obj, Tensor):
        key = f"{prefix}.{len(tensors)}"
        tensors[key] = obj.detach().cpu()
        return {_TENSOR: key}
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj):
            return {k: split_tensors(v, tensors, prefix) for k, v in obj.items()}
        return {
            _ITEMS: [[split_tensors(k, tensors, prefix), split_tensors(v, tensors, prefix)] for k, v in obj.items()]
        }
    if isinstance(obj, tuple):
        return {_TUPLE: [split_tensors(v, tensors, prefix) for v in obj]}
    if isinstance(obj, list):
        return [split_tensors(v, tensors, prefix) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    try:  # numpy scalars and arrays (numpy's RNG state)
        import numpy as np

        if isinstance(obj, np.ndarray):  # small arrays only (numpy's RNG key): exact as JSON integers/floats
            return {_NDARRAY: obj.tolist(), "dtype": str(obj.dtype)}
        if isinstance(obj, np.generic):
            return obj.item()
    except ImportError:  # pragma: no cover - numpy ships with torch
        pass
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__} without pickle: {obj!r:.80}")


def join_tensors(obj: Any, tensors: Mapping[str, Tensor]) -> Any:
    """Inverse of :func:`split_tensors`."""
    if isinstance(obj, dict):
        if _TENSOR in obj and len(obj) == 1:
            return tensors[obj[_TENSOR]]
        if _TUPLE in obj and len(obj) == 1:
            return tuple(join_tensors(v, tensors) for v in obj[_TUPLE])
        if _NDARRAY in obj:
            import numpy as np

            return np.asarray(obj[_NDARRAY], dtype=obj["dtype"])
        if _ITEMS in obj and len(obj) == 1:
            return {join_tensors(k, tensors): join_tensors(v, tensors) for k, v in obj[_ITEMS]}
        return {k: join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_tensors(v, tensors) for v in obj]
    return obj
