"""Capabilities decide which components may run together (rlpost/core/api/capabilities.py): an update rule written
before capabilities existed, declaring no ``requires``, is a policy-gradient rule (``{edge-log-probs}``), and
``rlpost validate`` refuses it with a sampler that provides only clean samples (the built-in ``solver``, a toy one),
pointing at the documentation."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from rlpost import EDGE_LOG_PROBS, PolicyOptimizer, UpdateContext, UpdateResult
from rlpost.apps import cli
from rlpost.apps.host import build_host
from rlpost.engine.recipe import RecipeError, validate
from tests import toy_components
from tests.toy_components import toy_recipe

ROOT = Path(__file__).resolve().parents[2]


class LegacyRule(PolicyOptimizer):
    """A third-party rule as written before capabilities: it declares nothing."""

    name: ClassVar[str] = "legacy-rule"

    def update(self, ctx: UpdateContext) -> UpdateResult:
        edges = ctx.rollout.trainable.nonzero().flatten()
        forwards = ctx.sampler.evaluate(ctx.policy, ctx.rollout, edges).forwards
        return UpdateResult(
            trained_edges=int(edges.numel()), train_forwards=forwards, reference_forwards=0, nonfinite_losses=0
        )


def _clean_recipe(tmp_path: Path, optimizer: str) -> dict[str, Any]:
    cfg = toy_recipe(str(tmp_path / "run"))
    cfg["sampler"] = {"class_path": "tests.toy_components.ToyCleanSampler", "init_args": {"num_steps": 3}}
    cfg["advantage"] = {"class_path": "group-zscore"}
    cfg["optimizer"] = {"class_path": optimizer}
    return cfg


def test_a_rule_declaring_nothing_requires_edge_log_probs() -> None:
    assert LegacyRule.requires == frozenset({EDGE_LOG_PROBS})
    assert LegacyRule().requires == {"edge-log-probs"}


def test_validate_refuses_a_legacy_rule_with_a_clean_samples_sampler(tmp_path: Path) -> None:
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    with pytest.raises(RecipeError) as err:
        validate(_clean_recipe(tmp_path, "tests.unit.test_capabilities.LegacyRule"), host)
    problems = [p for p in err.value.problems if p.startswith("optimizer:")]
    assert problems == [
        "optimizer: 'legacy-rule' requires the capability 'edge-log-probs', which sampler 'toy-clean' does not "
        "provide (it provides ['chains', 'clean-samples']); see docs/writing_plugins.md, 'Capabilities'"
    ]
    # A likelihood-free rule, which declares clean-samples, is accepted with the same sampler.
    recipe = validate(_clean_recipe(tmp_path, "toy-flow-matching"), host)
    assert recipe.optimizer.requires == {"clean-samples"}


def test_validate_refuses_a_legacy_rule_with_the_solver_sampler(tmp_path: Path) -> None:
    """The built-in rollout sampler of likelihood-free rules (rlpost/components/solver_sampler.py) provides clean
    samples and chains, no edge log-probs: a rule declaring nothing is refused with it, a likelihood-free one is not."""
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    cfg = _clean_recipe(tmp_path, "tests.unit.test_capabilities.LegacyRule")
    cfg["sampler"] = {"class_path": "solver", "init_args": {"solver": "euler", "num_steps": 3}}
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    assert [p for p in err.value.problems if p.startswith("optimizer:")] == [
        "optimizer: 'legacy-rule' requires the capability 'edge-log-probs', which sampler 'solver' does not "
        "provide (it provides ['chains', 'clean-samples']); see docs/writing_plugins.md, 'Capabilities'"
    ]
    cfg["optimizer"] = {"class_path": "toy-flow-matching"}
    assert validate(cfg, host).sampler.name == "solver"


def test_rlpost_validate_exits_2_naming_the_capability(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _clean_recipe(tmp_path, "tests.unit.test_capabilities.LegacyRule")
    cfg["model"] = {"class_path": "tests.toy_components.ToyPolicy"}
    cfg["rewards"] = [{"class_path": "tests.toy_components.ToyMeanReward"}]
    path = tmp_path / "legacy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli.main(["validate", "--recipe", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "'legacy-rule' requires the capability 'edge-log-probs', which sampler 'toy-clean' does not provide" in err
    assert "Traceback" not in err


def test_the_section_the_error_points_at_exists() -> None:
    text = (ROOT / "docs" / "writing_plugins.md").read_text()
    assert "\n## Capabilities\n" in text
    section = text.split("\n## Capabilities\n", 1)[1].split("\n## ", 1)[0]
    for name in ("edge-log-probs", "clean-samples", "chains", "tree", "rlpost validate"):
        assert name in section, name
