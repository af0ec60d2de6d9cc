"""Held-out evaluation (fixed prompts and seeds, ODE sampling, every eval reward) and sample grids."""

from __future__ import annotations

import json
import sys
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from rlpost import hookimpl
from rlpost.api import RewardSource
from rlpost.plugins import PluginHost
from rlpost.recipe import RecipeError, validate
from rlpost.runner import Runner
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


@pytest.fixture
def host() -> PluginHost:
    return PluginHost(load_entrypoints=False, extra_plugins=(toy_components, sys.modules[__name__]))


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
