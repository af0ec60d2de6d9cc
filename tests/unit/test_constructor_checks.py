"""Every component's argument checks run inside ``validate`` and report through the recipe's problem lines.

A constructor argument declares its range in its annotation (``Annotated[float, Range(gt=0, lt=1)]``,
``rlpost/core/api/arguments.py``); ``Component.__new__`` refuses a value outside it with ``InvalidArguments``, which
validation reports as ``SECTION.init_args.NAME: must be ..., got VALUE``. The walk below enumerates the registries of
the real plugin host, so a component a plugin adds is covered without a new test: every declared range is fed values
it refuses and must come back as a recipe error naming the field (exit 2 through the CLI, nothing written).
"""

from __future__ import annotations

import copy
import inspect
import math
import pickle
import typing
from pathlib import Path
from typing import Annotated, Any

import pytest
import yaml

from rlpost import Component, InvalidArguments, Range
from rlpost.apps import cli
from rlpost.apps.host import build_host, reset_host
from rlpost.core.api.arguments import declared_ranges
from rlpost.engine.recipe import RecipeError, validate
from rlpost.models.sd3 import SD3Policy
from tests import toy_components
from tests.toy_components import toy_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY_TREEGRPO = ROOT / "recipes" / "tiny" / "treegrpo.yaml"

# Where each registry's components go in a recipe.
SECTION_OF = {
    "model": "model",
    "prompts": "prompts",
    "sampler": "sampler",
    "advantage": "advantage",
    "optimizer": "optimizer",
    "reward": "rewards[0]",
}
# Values for constructor arguments without a default, so that only the argument under test is refused. A component
# with a new required argument fails test_every_required_argument_has_a_sample_value until it gets one here.
REQUIRED = {"pretrained": "tiny-random", "path": "prompts.txt", "prompts": ["a red cube"]}


@pytest.fixture(scope="module")
def host() -> Any:
    return build_host(extra_plugins=(toy_components,))


@pytest.fixture(autouse=True)
def _no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(self: Any, device: Any) -> None:
        raise AssertionError("validation must not load a model")

    monkeypatch.setattr(SD3Policy, "setup", forbidden)


def _components(host: Any) -> list[tuple[str, str, type[Component]]]:
    """(registry kind, name, class) of every registered component but the test suite's toys."""
    return [
        (kind, name, registry.get(name).cls)
        for kind, registry in host.registries.items()
        for name in registry.names()
        if registry.get(name).cls.__module__ != toy_components.__name__
    ]


def _argument_type(cls: type, name: str) -> type:
    """The base type (``int``/``float``) under the annotation of ``cls``'s constructor argument ``name``."""
    for klass in inspect.getmro(cls):
        init = klass.__dict__.get("__init__")
        if init is not None and name in inspect.signature(init).parameters:
            hint = typing.get_type_hints(init, include_extras=True)[name]
            for arg in (hint, *typing.get_args(hint)):
                if typing.get_origin(arg) is Annotated:
                    return typing.cast(type, typing.get_args(arg)[0])
    raise AssertionError(f"{cls.__name__}.{name}: no Annotated range found")


def _refused_values(allowed: Range, typ: type) -> list[Any]:
    """Values of ``typ`` that ``allowed`` refuses: just past each bound, and NaN / infinity for floats."""
    bounds = [b for b in (allowed.ge, allowed.gt, allowed.le, allowed.lt) if b is not None]
    near = [v for b in bounds for v in (b - 1, b, b + 1)] + [-(10**9), 10**9]
    candidates: list[Any] = [typ(v) for v in near]
    if typ is float:
        candidates += [math.nan, math.inf, -math.inf]
    refused = [v for v in candidates if allowed.problem(v) is not None]
    return sorted(set(refused), key=repr)[:2] + ([math.nan] if typ is float else [])


def _cases(host: Any) -> list[tuple[str, str, type[Component], str, Any]]:
    return [
        (kind, name, cls, arg, value)
        for kind, name, cls in _components(host)
        for arg, allowed in declared_ranges(cls).items()
        for value in _refused_values(allowed, _argument_type(cls, arg))
    ]


def _recipe_with(kind: str, cls: type, init_args: dict[str, Any], out: Path) -> dict[str, Any]:
    """The toy recipe with ``cls`` (and ``init_args`` over sample values of its required arguments) in its section."""
    required = {
        p.name: REQUIRED[p.name]
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    cfg = toy_recipe(str(out))
    component = {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": {**required, **init_args}}
    if kind == "reward":
        cfg["rewards"] = [component]
    else:
        cfg[SECTION_OF[kind]] = component
    return cfg


def test_the_walk_covers_every_kind_and_the_reported_ranges(host: Any) -> None:
    """The walk is not empty: every kind declares ranges, among them the ones a hostile recipe hit."""
    cases = _cases(host)
    assert {kind for kind, *_ in cases} == set(SECTION_OF)
    walked = {(name, arg) for _, name, _, arg, _ in cases}
    for expected in [
        ("tree", "ratio"),
        ("jpeg-compressibility", "quality"),
        ("sd3", "resolution"),
        ("remote", "retries"),
    ]:
        assert expected in walked


def test_every_required_argument_has_a_sample_value(host: Any) -> None:
    for _, name, cls in _components(host):
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                assert p.name in REQUIRED, f"{name}: add a sample value for its required argument {p.name!r}"


def test_every_declared_default_is_allowed(host: Any) -> None:
    for _, name, cls in _components(host):
        for arg, allowed in declared_ranges(cls).items():
            param = next(
                k.__dict__["__init__"] for k in inspect.getmro(cls) if "__init__" in k.__dict__
            )  # the constructor jsonargparse reads
            default = inspect.signature(param).parameters[arg].default
            assert allowed.problem(default) is None, f"{name}.{arg}: default {default!r} is outside {allowed}"


def test_every_declared_range_is_refused_by_validate_naming_the_field(host: Any, tmp_path: Path) -> None:
    by_component: dict[tuple[str, type], dict[str, list[Any]]] = {}
    for kind, _, cls, arg, value in _cases(host):
        by_component.setdefault((kind, cls), {}).setdefault(arg, []).append(value)
    for (kind, cls), values in by_component.items():
        # One recipe per round, refusing every argument at once: InvalidArguments lists them all.
        for round_ in range(max(map(len, values.values()))):
            bad = {arg: v[round_] for arg, v in values.items() if round_ < len(v)}
            with pytest.raises(RecipeError) as err:
                validate(_recipe_with(kind, cls, bad, tmp_path / "run"), host)
            for arg, value in bad.items():
                where = f"{SECTION_OF[kind]}.init_args.{arg}: must be "
                found = [p for p in err.value.problems if p.startswith(where)]
                assert found, (cls.__name__, arg, value, err.value.problems)
                assert found[0].endswith(f"got {value}"), found[0]  # the value and the allowed range are named
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("section", "init_args", "field"),
    [
        ("rewards[0]", {"class_path": "remote", "init_args": {"url": "ftp://x"}}, "rewards[0].init_args.url: must"),
        ("model", {"class_path": "sd3", "init_args": {"pretrained": "tiny-random", "lora": {}, "full_finetune": True}},
         "model.init_args.full_finetune: true together with lora"),
    ],
)  # fmt: skip
def test_checks_in_the_constructor_body_name_their_field(host: Any, tmp_path: Path, section, init_args, field) -> None:
    cfg = toy_recipe(str(tmp_path / "run"))
    if section == "rewards[0]":
        cfg["rewards"] = [init_args]
    else:
        cfg[section] = init_args
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    assert any(p.startswith(field) for p in err.value.problems), err.value.problems


# ------------------------------------------------------------------------------------------- through the CLI


def _refused(capsys: pytest.CaptureFixture[str], command: str, out: Path, *options: str) -> str:
    rc = cli.main([command, "--recipe", str(TINY_TREEGRPO), "--run.output_dir", str(out), *options])
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert not out.exists(), "a refused recipe must write nothing"
    return " ".join(captured.err.split())


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (".nan", "sampler.init_args.ratio: must be a finite number in (0, 1), got nan"),
        ("-0.5", "sampler.init_args.ratio: must be in (0, 1), got -0.5"),
        ("1.0", "sampler.init_args.ratio: must be in (0, 1), got 1.0"),
    ],
)
def test_tree_ratio_out_of_range_is_a_recipe_error(capsys, tmp_path, command, value, message) -> None:
    reset_host(None)
    try:
        err = _refused(capsys, command, tmp_path / "run", "--sampler.init_args.ratio", value)
    finally:
        reset_host(None)
    assert message in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # The optimizer's check reads the sampler's counts; with the sampler refused it must not run (it raised).
        (["--sampler.init_args.window", "fixed"], "sampler.init_args.fixed_start: window 'fixed' needs a start"),
        (["--sampler.init_args.window", "progressive", "--sampler.init_args.stride", "0"],
         "sampler.init_args.stride: must be >= 1, got 0"),
        (["--rewards", "[{class_path: jpeg-compressibility, init_args: {quality: 0}}]"],
         "rewards[0].init_args.quality: must be in [1, 100], got 0"),
        (["--optimizer.init_args.clip_range", "-1"], "optimizer.init_args.clip_range: must be > 0, got -1.0"),
    ],
)  # fmt: skip
def test_component_problems_are_reported_not_raised(capsys, tmp_path, options, message) -> None:
    reset_host(None)
    try:
        err = _refused(capsys, "validate", tmp_path / "run", *options)
    finally:
        reset_host(None)
    assert message in err


# ---------------------------------------------------------------------------------------------- the mechanism


def test_range_texts_and_edges() -> None:
    assert str(Range(gt=0, lt=1)) == "in (0, 1)" and str(Range(ge=1, le=100)) == "in [1, 100]"
    assert str(Range(gt=0, le=1)) == "in (0, 1]" and str(Range(ge=2)) == ">= 2" and str(Range(lt=3)) == "< 3"
    assert Range(gt=0).problem(0.0) == "must be > 0, got 0.0"
    assert Range(gt=0).problem(math.inf) == "must be a finite number > 0, got inf"
    assert Range().problem(math.nan) == "must be a finite number, got nan"
    assert Range(finite=False, gt=0).problem(math.inf) is None
    assert Range(ge=0, le=1).problem(1) is None and Range(ge=0, le=1).problem(None) is None
    assert Range(ge=1).problem(True) is None  # booleans and non-numbers are the type check's
    assert Range(le=100).problem(10**400) == f"must be <= 100, got {10**400}"  # no float overflow
    with pytest.raises(ValueError, match="at most one lower bound"):
        Range(ge=0, gt=0)


class _Base(Component):
    def __init__(self, k: Annotated[int, Range(ge=2)] = 3, ratio: Annotated[float, Range(gt=0, lt=1)] = 0.5) -> None:
        self.k, self.ratio = k, ratio


class _Passes(_Base):
    """Passes ``k`` on by keyword: its range is still checked (as jsonargparse reads ``**kwargs`` up the MRO)."""

    def __init__(self, extra: Annotated[int, Range(ge=0)] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = extra


def test_construction_refuses_every_argument_outside_its_range_at_once() -> None:
    with pytest.raises(InvalidArguments) as err:
        _Base(1, ratio=math.nan)
    assert err.value.owner == "_Base"
    assert err.value.problems == {"k": "must be >= 2, got 1", "ratio": "must be a finite number in (0, 1), got nan"}
    assert str(err.value) == "_Base: k must be >= 2, got 1; ratio must be a finite number in (0, 1), got nan"
    with pytest.raises(InvalidArguments, match="k must be >= 2"):
        _Passes(k=0)
    with pytest.raises(InvalidArguments, match="extra must be >= 0"):
        _Passes(extra=-1)
    assert _Passes(extra=None, k=2).k == 2
    assert set(declared_ranges(_Passes)) == {"extra", "k", "ratio"}
    with pytest.raises(TypeError):  # arguments that do not bind are __init__'s to refuse, as usual
        _Base(nope=1)  # type: ignore[call-arg]


def test_copies_and_pickles_bypass_the_check() -> None:
    one = _Base(k=5, ratio=0.25)
    assert copy.deepcopy(one).k == 5 and pickle.loads(pickle.dumps(one)).ratio == 0.25


def test_the_parser_still_reads_the_constructor_signature(capsys: pytest.CaptureFixture[str]) -> None:
    """``Component.__new__`` hides no argument from jsonargparse (``--sampler.help tree``)."""
    reset_host(None)
    try:
        assert cli.main(["validate", "--sampler.help", "tree"]) == 0
    finally:
        reset_host(None)
    out = capsys.readouterr().out
    assert "--sampler.ratio" in out and "--sampler.k" in out


def test_the_tiny_recipe_still_validates(host: Any) -> None:
    cfg = yaml.safe_load(TINY_TREEGRPO.read_text())
    assert validate(cfg, build_host()).sampler.ratio == 0.5
