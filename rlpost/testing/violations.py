"""How a conformance check reports: every broken rule of one component, collected, then raised as one error; and
the state comparisons the checks share.

A check runs the component the way the engine does and keeps going after a violation, so one run lists everything
that is wrong (pytest's assertion-per-test would stop at the first). A call that raises is itself a violation, and
the checks that needed its result are skipped rather than reported twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

__all__ = ["Checker", "ConformanceError", "same_state", "snapshot"]

T = TypeVar("T")


class ConformanceError(AssertionError):
    """A component breaks the rlpost component contract.

    An ``AssertionError``, so pytest reports it as a failed test with the whole list.

    Args:
        component: What was checked (``sampler 'tree' (rlpost_treegrpo.sampler.TreeSampler)``).
        violations: One line per broken rule.
    """

    def __init__(self, component: str, violations: Sequence[str]) -> None:
        self.component, self.violations = component, list(violations)
        lines = "\n  - ".join(self.violations)
        count = f"{len(self.violations)} broken rule" + ("s" if len(self.violations) != 1 else "")
        super().__init__(f"{component} breaks the rlpost component contract ({count}):\n  - {lines}")


def describe(kind: str, component: object) -> str:
    """``<kind> '<name>' (<module>.<class>)`` for messages."""
    cls = type(component)
    name = getattr(component, "name", "") or cls.__name__
    return f"{kind} {name!r} ({cls.__module__}.{cls.__qualname__})"


class Checker:
    """Collects the violations of one component's check.

    Args:
        kind: The component kind, as messages name it (``sampler``, ``update rule``, ...).
        component: The component under check.
    """

    def __init__(self, kind: str, component: object) -> None:
        self.component = describe(kind, component)
        self.violations: list[str] = []

    def expect(self, ok: bool, violation: str) -> bool:
        """Record ``violation`` unless ``ok``; returns ``ok``."""
        if not ok:
            self.violations.append(violation)
        return ok

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``, or ``None`` with the exception recorded as ``what raised Type: message``."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a component's exception is a finding, not a crash of the kit
            text = str(exc).strip().splitlines()
            self.violations.append(f"{what} raised {type(exc).__name__}" + (f": {text[0][:300]}" if text else ""))
            return None

    def ran(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Like :meth:`call` for a function whose result does not matter: whether it returned without raising."""
        before = len(self.violations)
        self.call(what, fn, *args, **kwargs)
        return len(self.violations) == before

    def done(self) -> None:
        """Raise the collected violations, if any.

        Raises:
            ConformanceError: At least one rule was broken.
        """
        __tracebackhide__ = True  # pytest shows the component's violations, not the kit's frames
        if self.violations:
            raise ConformanceError(self.component, self.violations)


def same_state(a: Any, b: Any) -> bool:
    """Whether two state trees (dicts, lists, tuples, tensors, scalars) hold the same values: a copy or a restore
    compares equal bit for bit (no arithmetic between the two sides); NaN equals NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        if a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
        return bool(torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return bool(a == b)


def snapshot(*objects: Any) -> list[Any]:
    """Copies of every tensor, list and dict reachable in ``objects`` (dataclass fields included), to tell later
    whether a component changed its inputs in place."""

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [copy(v) for v in value]
        if hasattr(value, "__dataclass_fields__"):
            return {f: copy(getattr(value, f)) for f in value.__dataclass_fields__ if f != "stash"}
        return value

    return [copy(o) for o in objects]
