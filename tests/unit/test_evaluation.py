"""Held-out evaluation (fixed prompts and seeds, ODE sampling, every eval reward, named sets, second judges) and
sample grids."""

from __future__ import annotations

import json
import sys
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from rlpost import hookimpl
from rlpost.apps.host import build_host
from rlpost.core.api import RewardSource
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import RecipeError, validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.tolerances import assert_pixels_close
from tests.toy_components import toy_recipe


class ToyDarkness(RewardSource):
    """An evaluation-only reward (not trained on): 1 - brightness."""

    name: ClassVar[str] = "toy-darkness"

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> torch.Tensor:
        return 1.0 - images.float().mean(dim=(1, 2, 3)) / 255.0


@hookimpl
def rlpost_register_reward_sources(register: Any) -> None:
    register(ToyDarkness)
    register(CountingJudge)


@pytest.fixture
def host() -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components, sys.modules[__name__]))


def _cfg(tmp_path, **eval_args):
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=4)
    cfg["eval"] = {
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": ["held out one", "held out two"]}},
        "rewards": [{"class_path": "toy-brightness"}, {"class_path": "toy-darkness"}],
        "num_steps": 3,
        "every": 2,
        "seed": 11,
        "batch_size": 1,
        **eval_args,
    }
    cfg["logging"] = {"grid_every": 2}
    return cfg


def test_eval_writes_every_reward_and_grids(tmp_path, host):
    recipe = validate(_cfg(tmp_path), host)
    assert recipe.eval is not None and recipe.eval.rewards[0] is recipe.rewards[0], "same config shares the instance"
    Runner(recipe, host).run()
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 4]  # "before" reference, every 2, end
    for r in records:
        assert {"eval/toy-brightness", "eval/toy-darkness"} <= r.keys()
        assert abs(r["eval/toy-brightness"] + r["eval/toy-darkness"] - 1.0) < 1e-6
        assert [p["seed"] for p in r["per_prompt"]] == [11, 12]
    table = (run / "eval.md").read_text()
    assert "| step | toy-brightness | toy-darkness |" in table and "| 4 |" in table
    for step in (2, 4):
        assert Image.open(run / "grids" / f"step_{step:06d}.png").size[0] >= 128
    assert Image.open(run / "eval" / "step_000000.png").mode == "RGB"
    assert (run / "eval" / "step_000004" / "0001.png").is_file()
    # Fixed seeds: the step-0 images depend only on the initial weights, not on batch size (up to one level of
    # rounding: another batch size may take other float kernels). Noise drawn per batch would differ everywhere.
    again = validate(_cfg(tmp_path / "b", batch_size=2), host)
    again.run.max_steps = 1
    Runner(again, host).run()
    for i in range(2):
        a = np.asarray(Image.open(run / "eval" / "step_000000" / f"{i:04d}.png"))
        b = np.asarray(Image.open(tmp_path / "b" / "run" / "eval" / "step_000000" / f"{i:04d}.png"))
        assert_pixels_close(a, b)


def test_eval_section_problems_are_all_reported(tmp_path, host):
    cfg = _cfg(tmp_path, num_steps=0, rewards=[{"class_path": "toy-brightnes"}], bogus=1)
    del cfg["eval"]["prompts"]
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    text = str(err.value)
    for expected in ("eval.bogus: unknown key", "eval.prompts: missing", "eval.rewards[0].class_path: unknown reward"):
        assert expected in text
    assert "eval.num_steps: must be >= 1" in text


class CountingJudge(RewardSource):
    """A second judge that records every batch it scores (darkness, like ToyDarkness, under another name)."""

    name: ClassVar[str] = "toy-judge"
    calls: ClassVar[list[list[str]]] = []

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> torch.Tensor:
        CountingJudge.calls.append(list(prompts))
        return 1.0 - images.float().mean(dim=(1, 2, 3)) / 255.0


def _sets_cfg(tmp_path, **eval_args):
    cfg = _cfg(tmp_path, **eval_args)
    del cfg["eval"]["prompts"]
    cfg["eval"]["sets"] = {
        "unseen": {"class_path": "prompt-list", "init_args": {"prompts": ["held out one", "held out two"]}},
        "train": {"class_path": "prompt-list", "init_args": {"prompts": ["a cat"]}},
    }
    cfg["eval"]["rewards"] = [{"class_path": "toy-brightness"}]
    cfg["eval"]["judges"] = [{"class_path": "toy-judge"}]
    return cfg


def test_eval_sets_and_judges_are_logged_separately(tmp_path, host):
    CountingJudge.calls.clear()
    recipe = validate(_sets_cfg(tmp_path), host)
    assert recipe.eval is not None and list(recipe.eval.sets) == ["unseen", "train"]
    assert [j.name for j in recipe.eval.judges] == ["toy-judge"]
    Runner(recipe, host).run()
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 4]
    expected = {f"eval/{s}/{k}" for s in ("unseen", "train") for k in ("toy-brightness", "judge/toy-judge")}
    for r in records:
        assert r["sets"] == ["unseen", "train"] and r["judges"] == ["toy-judge"] and r["eval_sec"] > 0
        assert expected == {k for k in r if k.startswith("eval/")}
        for s in ("unseen", "train"):
            assert abs(r[f"eval/{s}/toy-brightness"] + r[f"eval/{s}/judge/toy-judge"] - 1.0) < 1e-6
        rows = r["per_prompt"]
        assert [(p["set"], p["prompt"], p["seed"]) for p in rows] == [
            ("unseen", "held out one", 11),
            ("unseen", "held out two", 12),
            ("train", "a cat", 11),
        ]
        assert all({"toy-brightness", "judge/toy-judge"} <= p.keys() for p in rows)
        assert abs(sum(p["judge/toy-judge"] for p in rows[:2]) / 2 - r["eval/unseen/judge/toy-judge"]) < 1e-6
    # The judge saw evaluation prompts only: one batch per set per evaluation, never a training rollout.
    assert CountingJudge.calls == [["held out one", "held out two"], ["a cat"]] * 3
    table = (run / "eval.md").read_text()
    assert "## unseen" in table and "## train" in table and "second judges" in table
    assert "| step | toy-brightness | judge/toy-judge |" in table
    for s, n in (("unseen", 2), ("train", 1)):
        assert (run / "eval" / s / "step_000004.png").is_file()
        assert len(list((run / "eval" / s / "step_000004").glob("*.png"))) == n


def test_judges_never_reach_training(tmp_path, host):
    """Training rewards, reward weights, the advantage estimator and metrics.jsonl never see a judge."""
    CountingJudge.calls.clear()
    recipe = validate(_sets_cfg(tmp_path, every=0), host)
    assert [r.name for r in recipe.rewards] == ["toy-brightness"] and recipe.reward_weights == {"toy-brightness": 1.0}
    seen: list[set[str]] = []
    estimate = recipe.advantage.estimate

    def spy(rollout, scores):
        seen.append(set(scores.scores))
        assert len(CountingJudge.calls) == 2, "judge scored something outside an evaluation"
        return estimate(rollout, scores)

    recipe.advantage.estimate = spy  # type: ignore[method-assign]
    Runner(recipe, host).run()
    assert seen and all(names == {"toy-brightness"} for names in seen)
    assert len(CountingJudge.calls) == 4  # step 0 and the end, two sets each
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        assert not [k for k in json.loads(line) if "judge" in k]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda e: e.update(prompts=e["sets"]["unseen"]), "eval.sets: give either eval.prompts"),
        (lambda e: e.update(sets={}), "eval.sets: expected a non-empty mapping"),
        (lambda e: e["sets"].update({"bad/name": e["sets"]["train"]}), "eval.sets.bad/name: bad set name"),
        (lambda e: e["sets"].update({"judge": e["sets"]["train"]}), "eval.sets.judge: bad set name"),
        (lambda e: e["sets"].update(x={"class_path": "prompt-lst"}), "eval.sets.x.class_path: unknown prompts"),
        (
            lambda e: e["sets"].update(x={"class_path": "prompt-list", "init_args": {"prompts": []}}),
            "eval.sets.x.init_args.prompts: the prompt list is empty",
        ),
        (lambda e: e.update(judges=[{"class_path": "toy-judg"}]), "eval.judges[0].class_path: unknown reward"),
        (
            lambda e: e.update(judges=[{"class_path": "toy-brightness"}]),
            "eval.judges[0]: 'toy-brightness' is a training",
        ),
        (lambda e: e.update(judges=["toy-judge", "toy-judge"]), "eval.judges[1]: 'toy-judge' listed twice"),
        (lambda e: e.update(judges={"a": 1}), "eval.judges: expected a list"),
        (
            lambda e: e.update(rewards=["toy-brightness", "toy-judge"]),
            "eval.judges[0]: 'toy-judge' is also in eval.rewards",
        ),
    ],
)
def test_bad_sets_and_judges_name_their_field(tmp_path, host, change, expected):
    cfg = _sets_cfg(tmp_path)
    change(cfg["eval"])
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    assert expected in str(err.value)


def test_grid_shows_a_spread_subset_of_a_large_set(tmp_path, host, monkeypatch):
    import rlpost.engine.evaluation.grids

    monkeypatch.setattr(rlpost.engine.evaluation.grids, "GRID_MAX_IMAGES", 2)
    cfg = _sets_cfg(tmp_path, every=0)
    cfg["eval"]["sets"]["unseen"]["init_args"]["prompts"] = ["p0", "p1", "p2", "p3", "p4"]
    recipe = validate(cfg, host)
    recipe.run.max_steps = 1
    Runner(recipe, host).run()
    run = tmp_path / "run"
    assert Image.open(run / "eval" / "unseen" / "step_000000.png").size[0] == 2 * 128  # p0 and p4, one row
    assert len(list((run / "eval" / "unseen" / "step_000000").glob("*.png"))) == 5  # every image kept


def test_run_evaluates_inside_the_published_weights_and_stashes_the_metrics(tmp_path, host):
    """``evaluation.run`` (the runner's one entry point): timed as ``eval``, inside the weights context it is given,
    metrics left in the stash; nothing at all without an ``eval`` section."""
    import contextlib

    from rlpost.engine import evaluation

    runner = Runner(validate(_cfg(tmp_path), host), host)
    runner.begin()
    try:
        entered: list[int] = []

        @contextlib.contextmanager
        def weights():
            entered.append(runner.ctx.step)
            yield

        metrics = evaluation.run(runner.evaluator, runner.ctx, weights=weights(), phases=runner.phases)
        assert entered == [0] and runner.phases.totals["eval"] > 0
        assert runner.ctx.stash[evaluation.LAST_EVAL] is metrics and "eval/toy-brightness" in metrics
        assert evaluation.run(None, runner.ctx, weights=weights()) == {} and entered == [0]
        assert runner.ctx.stash[evaluation.LAST_EVAL] is metrics
        assert runner.evaluate()["eval/toy-brightness"] == metrics["eval/toy-brightness"]  # same weights, same images
    finally:
        runner.finish("completed")
    assert len((tmp_path / "run" / "eval.jsonl").read_text().splitlines()) == 2
