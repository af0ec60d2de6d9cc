"""A component's argument checks, declared next to the arguments and run when the component is constructed.

A constructor argument with a numeric range declares it in its annotation, ``ratio: Annotated[float, Range(gt=0,
lt=1)] = 0.5``; jsonargparse still sees a ``float`` (it ignores annotation metadata it does not know), and
:class:`~rlpost.core.api.Component` checks every declared range before ``__init__`` runs, raising
:class:`InvalidArguments` with one problem per argument. A check that is no range (a URL's form, two arguments that
exclude each other) raises :class:`InvalidArguments` from ``__init__`` itself. Recipe validation instantiates each
component and reports each of these problems under its field (``sampler.init_args.ratio: must be in (0, 1), got
nan``), and :func:`declared_ranges` lets a test feed every declared range a value it refuses.

Part of :mod:`rlpost.core.api` (the package re-exports every name).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Union

__all__ = ["InvalidArguments", "Range", "constructor_problems", "declared_ranges"]


@dataclass(frozen=True)
class Range:
    """The values a numeric argument allows: at most one lower (``ge``/``gt``) and one upper (``le``/``lt``) bound,
    and a finite number unless ``finite`` is false (NaN is always refused). ``None`` and non-numbers are left to the
    type check.

    Attributes:
        ge: Smallest allowed value.
        gt: The value must exceed this.
        le: Largest allowed value.
        lt: The value must stay below this.
        finite: Refuse ``inf`` and ``-inf``.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = True

    def __post_init__(self) -> None:
        if self.ge is not None and self.gt is not None or self.le is not None and self.lt is not None:
            raise ValueError("Range: give at most one lower bound (ge or gt) and one upper bound (le or lt)")

    def __str__(self) -> str:
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        high = (self.le, "]") if self.le is not None else (self.lt, ")") if self.lt is not None else None
        if low is not None and high is not None:
            return f"in {low[0]}{low[1]}, {high[0]}{high[1]}"
        if low is not None:
            return f"{'>=' if low[0] == '[' else '>'} {low[1]}"
        if high is not None:
            return f"{'<=' if high[1] == ']' else '<'} {high[0]}"
        return "finite" if self.finite else "a number"

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is refused (``must be in (0, 1), got nan``), or ``None``."""
        if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None
        # An int is compared as it is: float() of a huge YAML integer would overflow.
        number: int | float = int(value) if isinstance(value, numbers.Integral) else float(value)
        if isinstance(number, float) and (math.isnan(number) or (self.finite and math.isinf(number))):
            bounds = "" if str(self) == "finite" else f" {self}"
            return f"must be a finite number{bounds}, got {value}"
        inside = (
            (self.ge is None or number >= self.ge)
            and (self.gt is None or number > self.gt)
            and (self.le is None or number <= self.le)
            and (self.lt is None or number < self.lt)
        )
        return None if inside else f"must be {self}, got {value}"


class InvalidArguments(ValueError):
    """A component's constructor refused some of its arguments.

    Attributes:
        owner: The component class's name.
        problems: Argument name -> what is wrong with its value (``must be in (0, 1), got nan``), without the name.
    """

    def __init__(self, owner: str, problems: Mapping[str, str]) -> None:
        self.owner = owner
        self.problems = dict(problems)
        super().__init__(f"{owner}: " + "; ".join(f"{name} {text}" for name, text in self.problems.items()))


@dataclass(frozen=True)
class _Declared:
    """The declared ranges of one class's constructor arguments, with the signature they are bound by."""

    signature: inspect.Signature | None
    ranges: dict[str, Range]
    defaults: dict[str, Any]


def declared_ranges(cls: type) -> dict[str, Range]:
    """The :class:`Range` of each constructor argument of ``cls`` that declares one, following ``**kwargs`` up the
    MRO as jsonargparse does (an argument of a base class's constructor that a subclass passes on by keyword)."""
    return dict(_declared(cls).ranges)


def constructor_problems(cls: type, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, str]:
    """The declared ranges of ``cls``'s constructor checked on the arguments of one call (omitted ones: their
    defaults). Arguments that do not bind to the signature are left to ``__init__``, which raises the usual
    ``TypeError``; so is a bare ``cls.__new__(cls)`` (``copy``, ``pickle``)."""
    declared = _declared(cls)
    if not declared.ranges or declared.signature is None:
        return {}
    try:
        bound = declared.signature.bind(None, *args, **kwargs)
    except TypeError:
        return {}
    given: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = declared.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            given.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            given[name] = value
    problems: dict[str, str] = {}
    for name, allowed in declared.ranges.items():
        problem = allowed.problem(given.get(name, declared.defaults.get(name)))
        if problem is not None:
            problems[name] = problem
    return problems


@functools.cache
def _declared(cls: type) -> _Declared:
    ranges: dict[str, Range] = {}
    defaults: dict[str, Any] = {}
    signature: inspect.Signature | None = None
    seen: set[str] = set()
    for klass in inspect.getmro(cls):
        init = klass.__dict__.get("__init__")
        if init is None or init is object.__init__:
            continue
        sig = inspect.signature(init)
        signature = signature or sig
        hints = _hints(init)
        params = list(sig.parameters.values())[1:]
        for param in params:
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name in seen:
                continue
            seen.add(param.name)
            allowed = _range_of(hints.get(param.name))
            if allowed is not None:
                ranges[param.name] = allowed
                defaults[param.name] = None if param.default is param.empty else param.default
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return _Declared(signature, ranges, defaults)


def _hints(function: Any) -> dict[str, Any]:
    """``function``'s resolved annotations with their ``Annotated`` metadata; parameter by parameter when one of
    them cannot be resolved (a name imported only for type checking), skipping that one."""
    try:
        return typing.get_type_hints(function, include_extras=True)
    except Exception:  # noqa: BLE001 - NameError/TypeError from an annotation string; resolve the others alone
        pass
    found: dict[str, Any] = {}
    namespace = getattr(function, "__globals__", {})
    for name, annotation in getattr(function, "__annotations__", {}).items():
        try:
            found[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
        except Exception:  # noqa: BLE001 - as above: this annotation declares nothing we can read
            continue
    return found


def _range_of(annotation: Any) -> Range | None:
    """The :class:`Range` in ``annotation`` (``Annotated[T, Range(...)]``, possibly inside ``X | None``)."""
    if typing.get_origin(annotation) is Annotated:
        return next((m for m in annotation.__metadata__ if isinstance(m, Range)), None)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        found = [r for r in map(_range_of, typing.get_args(annotation)) if r is not None]
        return found[0] if found else None
    return None
