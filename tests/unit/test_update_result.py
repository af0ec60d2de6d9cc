"""The update rule's typed result (``rlpost.UpdateResult``): what the runner's guards and cost accounting read is a
required field, never a metric-name string, so a third-party rule cannot silently switch the loss guard off.

Planted third-party rules: one returning the old plain dict of metrics, one returning an object without the guard
fields, one putting a count in its free metrics, and one that passes a non-finite loss to ``backward`` without saying
so (the backend refuses and counts it: the guard still trips).
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from rlpost import PolicyOptimizer, UpdateContext, UpdateResult, hookimpl
from rlpost.apps.host import build_host
from rlpost.components.clipped_surrogate import ClippedSurrogate
from rlpost.core.api import update_result_problems
from rlpost.core.plugin_errors import PluginRuntimeError
from rlpost.engine.backend import LocalBackend
from rlpost.engine.guards import NonFiniteError
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from rlpost.engine.sharding import UpdateTotals, reduce_updates
from tests import toy_components
from tests.toy_components import toy_recipe
from tests.unit.test_guards import _nan_loss_at_step

COUNTS = "trained_edges, train_forwards, reference_forwards, nonfinite_losses"
DICT = f"returned a dict of metrics, expected rlpost.UpdateResult with the required fields {COUNTS}"
PARTIAL = "returned SimpleNamespace.*it lacks train_forwards, reference_forwards, nonfinite_losses"
AS_METRIC = r"metrics\['train/nonfinite_loss'\]: logged from the field nonfinite_losses"


def _result(**overrides: Any) -> UpdateResult:
    fields = {"trained_edges": 4, "train_forwards": 4, "reference_forwards": 0, "nonfinite_losses": 0}
    return UpdateResult(**{**fields, **overrides})


# ------------------------------------------------------------------------------------------- the contract


def test_a_complete_result_has_no_problems_and_counts_are_required():
    assert update_result_problems(_result(metrics={"loss/policy": 0.5, "train/steps": 1})) == []
    assert UpdateResult.count_fields() == tuple(COUNTS.split(", "))
    with pytest.raises(TypeError, match="nonfinite_losses"):
        UpdateResult(trained_edges=1, train_forwards=1, reference_forwards=0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        UpdateResult(1, 1, 0, 0)  # type: ignore[misc]  # keyword-only: counts cannot be swapped by position


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"loss/policy": 0.1}, DICT),
        (SimpleNamespace(trained_edges=3), PARTIAL),
        (None, "returned NoneType, expected rlpost.UpdateResult"),
        (_result(trained_edges=-1), r"UpdateResult.trained_edges: must be an integer >= 0, got -1"),
        (_result(train_forwards=2.0), r"UpdateResult.train_forwards: must be an integer >= 0, got 2.0"),
        (_result(nonfinite_losses=True), r"UpdateResult.nonfinite_losses: must be an integer >= 0, got True"),
        (_result(metrics={"train/nonfinite_loss": 0.0}), AS_METRIC),
        (_result(metrics={"train/edges": 4.0}), r"metrics\['train/edges'\]: logged from the field trained_edges"),
        (_result(metrics={"train/nonfinite_grad_steps": 0.0}), "the engine counts it from the backend"),
        (_result(metrics={"loss/policy": "low"}), r"metrics\['loss/policy'\]: must be a float, got str"),
        (_result(metrics=[1.0]), "UpdateResult.metrics: must be a dict of floats, got list"),
    ],
    ids=[
        *("dict", "partial-object", "none", "negative", "float-count", "bool-count"),
        *("count-as-metric", "edges-as-metric", "engine-metric", "str-metric", "list-metrics"),
    ],
)
def test_problems_name_the_field(value, problem):
    problems = update_result_problems(value)
    assert len(problems) == 1 and re.search(problem, problems[0]), problems


def test_logged_names_stay_the_documented_metric_names():
    totals = UpdateTotals(
        _result(trained_edges=6, train_forwards=3, reference_forwards=3, nonfinite_losses=1, metrics={"loss/kl": 0.2}),
        refused_losses=2,
        nonfinite_grad_steps=1,
    )
    assert totals.metrics() == {
        "loss/kl": 0.2,
        "train/edges": 6.0,
        "perf/train_forwards": 3.0,
        "perf/reference_forwards": 3.0,
        "train/nonfinite_loss": 3.0,  # the rule's one and the backend's two
        "train/nonfinite_grad_steps": 1.0,
    }


def test_ranks_sum_every_count_and_average_metrics():
    parts = [
        UpdateTotals(
            _result(trained_edges=4, reference_forwards=2, metrics={"loss/policy": 1.0, "train/ratio_max": 1.5})
        ),
        UpdateTotals(
            _result(trained_edges=2, nonfinite_losses=1, metrics={"loss/policy": 3.0, "train/ratio_max": 1.2}),
            refused_losses=1,
            nonfinite_grad_steps=1,
        ),
    ]
    total = reduce_updates(parts)
    assert (total.result.trained_edges, total.result.train_forwards, total.result.reference_forwards) == (6, 8, 2)
    assert (total.nonfinite_losses, total.nonfinite_grad_steps) == (2, 1)
    assert total.result.metrics == {"loss/policy": 2.0, "train/ratio_max": 1.5}
    assert total.result.copy_forwards == {}  # no rank split its no-grad rows: all were the reference's


def test_ranks_sum_the_rows_of_each_weight_copy():
    parts = [
        UpdateTotals(_result(reference_forwards=5, copy_forwards={"old": 3, "reference": 2})),
        UpdateTotals(_result(reference_forwards=4)),  # no split: the reference's
    ]
    total = reduce_updates(parts)
    assert total.result.reference_forwards == 9
    assert total.result.copy_forwards == {"old": 3, "reference": 6}


# ------------------------------------------------------------------------------------------- the backend


def test_backend_refuses_and_counts_nonfinite_losses_and_gradients():
    theta = torch.nn.Parameter(torch.ones(2))
    backend = LocalBackend([theta], torch.optim.SGD([theta], lr=1.0), max_grad_norm=None)
    backend.backward((theta * float("nan")).sum())
    assert backend.refused_losses == 1 and theta.grad is None  # never reached the gradients
    backend.backward(theta.sum())
    backend.step()
    assert backend.num_steps == 1 and float(theta.detach().abs().max()) < 1e-6  # 1 - lr * 1
    before = theta.detach().clone()
    theta.grad = torch.full((2,), float("inf"))  # a finite loss can still give a non-finite gradient
    assert "train/nonfinite_grad_steps" not in backend.step()  # the engine reads the counter, not a metric name
    assert backend.skipped_steps == 1 and torch.equal(theta.detach(), before)


# ------------------------------------------------------------------------------ planted third-party rules


class LegacyDictRule(ClippedSurrogate):
    """An update rule written against the old contract: a plain dict of metrics, no guard fields."""

    name: ClassVar[str] = "legacy-dict-rule"

    def update(self, ctx: UpdateContext) -> Any:
        return dict(super().update(ctx).metrics)


class PartialRule(ClippedSurrogate):
    """Returns its own object carrying only some of the counts."""

    name: ClassVar[str] = "partial-rule"

    def update(self, ctx: UpdateContext) -> Any:
        result = super().update(ctx)
        return SimpleNamespace(trained_edges=result.trained_edges, metrics=result.metrics)


class CountInMetricsRule(ClippedSurrogate):
    """Returns the typed result but also reports the loss count under its old metric name."""

    name: ClassVar[str] = "count-in-metrics-rule"

    def update(self, ctx: UpdateContext) -> Any:
        result = super().update(ctx)
        return UpdateResult(
            trained_edges=result.trained_edges,
            train_forwards=result.train_forwards,
            reference_forwards=result.reference_forwards,
            nonfinite_losses=0,
            metrics={**result.metrics, "train/nonfinite_loss": float(result.nonfinite_losses)},
        )


class UncheckedRule(PolicyOptimizer):
    """Plain policy gradient that hands every loss to ``backward`` without checking it and always reports no
    non-finite loss: the backend must catch what the rule does not."""

    name: ClassVar[str] = "unchecked-rule"

    def update(self, ctx: UpdateContext) -> UpdateResult:
        edges = ctx.rollout.trainable.nonzero().flatten()
        evaluation = ctx.sampler.evaluate(ctx.policy, ctx.rollout, edges)
        ratio = torch.exp(evaluation.log_prob - ctx.rollout.old_log_probs[edges].to(torch.float64))
        ctx.backend.backward(-(ctx.advantages.edges[edges].double() * ratio).mean())
        ctx.backend.step()
        return UpdateResult(
            trained_edges=int(edges.numel()),
            train_forwards=evaluation.forwards,
            reference_forwards=0,
            nonfinite_losses=0,
            metrics={"loss/policy": math.nan},
        )


class RulePlugin:
    @hookimpl
    def rlpost_register_optimizers(self, register: Any) -> None:
        for rule in (LegacyDictRule, PartialRule, CountInMetricsRule, UncheckedRule):
            register(rule)


def _runner(tmp_path, rule: str, policy: str = "stop", steps: int = 2) -> Runner:
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components, RulePlugin()))
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=steps)
    cfg["optimizer"] = {"class_path": rule}
    cfg["guards"] = {"on_nonfinite": policy}
    return Runner(validate(cfg, host), host)


@pytest.mark.parametrize(
    ("rule", "why"),
    [
        ("legacy-dict-rule", DICT),
        ("partial-rule", PARTIAL),
        ("count-in-metrics-rule", AS_METRIC),
    ],
)
def test_a_rule_dropping_the_guard_fields_fails_the_run_naming_its_plugin(tmp_path, rule, why):
    runner = _runner(tmp_path, rule, policy="skip")
    where = f"optimizer '{rule}' of plugin 'RulePlugin-1'"
    with pytest.raises(PluginRuntimeError, match=f"{where}.*update\\(\\): .*{why}") as err:
        runner.run()
    assert err.value.distribution == "<local>" and err.value.plugin == "RulePlugin-1"
    assert runner.ctx.step == 0  # not one step ran with its guards off
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_a_nonfinite_loss_the_rule_does_not_report_still_trips_the_guard(tmp_path, monkeypatch):
    runner = _runner(tmp_path, "unchecked-rule", policy="skip", steps=3)
    _nan_loss_at_step(runner, 1, monkeypatch)
    history = runner.run()
    assert [m["guard/nonfinite_loss"] for m in history] == [0.0, 1.0, 0.0]
    assert [m["train/nonfinite_loss"] for m in history] == [0.0, 1.0, 0.0]
    assert history[2]["guard/skipped_steps"] == 1
    assert runner.recipe.model.a is not None and torch.isfinite(runner.recipe.model.a).all()

    stopping = _runner(tmp_path / "stop", "unchecked-rule", policy="stop", steps=3)
    _nan_loss_at_step(stopping, 1, monkeypatch)
    with pytest.raises(NonFiniteError, match="1 non-finite loss value"):
        stopping.run()


def test_first_party_rule_logs_every_count_under_its_metric_name(tmp_path):
    runner = _runner(tmp_path, "clipped-surrogate", steps=1)
    (metrics,) = runner.run()
    assert runner.last_update is not None
    result = runner.last_update.result
    assert result.trained_edges == 2 * 4 * 3 == metrics["train/edges"]  # 2 groups x 4 chains x 3 steps
    assert result.train_forwards == runner.recipe.counts().train_forwards == metrics["perf/train_forwards"]
    assert metrics["perf/reference_forwards"] == 0 and metrics["train/nonfinite_loss"] == 0
    assert metrics["train/nonfinite_grad_steps"] == 0
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert {k: line[k] for k in ("train/edges", "perf/train_forwards", "train/nonfinite_loss")} == {
        "train/edges": 24,
        "perf/train_forwards": 24,
        "train/nonfinite_loss": 0,
    }
