"""The loss guard (rlpost/engine/loss_guard.py): a run whose update rule is likelihood-free (it does not require
edge-log-probs) gets it instead of the ratio guard; it passes speed-ups that leave the loss as it is, refuses one that
changes it (exit 2, naming the speed-ups, the error and run.speedups.loss_tolerance), and leaves the run as it found
it. The likelihood-free rule is ``tests.toy_components.ToyFlowMatching`` (advantage-weighted flow matching with a pull
towards a weight copy ``old``), on the tiny SD3 with the DanceGRPO sampler's clean samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.apps.host import build_host
from rlpost.engine import runner as runner_module
from rlpost.engine.loss_guard import LossCheck, RecordingBackend, synthetic_advantages
from rlpost.engine.recipe import parse_recipe, validate
from rlpost.engine.runner import Runner
from tests.tolerances import FP32_ATOL
from tests.toy_components import ToyCleanSampler, ToyPolicy

ROOT = Path(__file__).resolve().parents[2]
TINY_DANCE = str(ROOT / "recipes" / "tiny" / "dancegrpo.yaml")
LIKELIHOOD_FREE = [
    ("optimizer", "{class_path: tests.toy_components.ToyFlowMatching, init_args: {draws: 2, kl_coef: 0.5}}"),
    ("copies", "{old: {rate: 0.001, cap: 0.5}}"),
    ("rewards", "[{class_path: tests.toy_components.ToyMeanReward}]"),
]
BF16_TRAIN = [("run.speedups.autocast", "bfloat16"), ("run.speedups.autocast_scope", "train")]
"""bf16 autocast of the forwards with gradients: the loss moves by bf16 rounding (measured 1.2e-2 relative on the
tiny SD3 with this rule), an order of magnitude past the default tolerance 1e-3."""


def _runner(tmp_path: Path, pairs: list[tuple[str, str]], name: str = "run") -> Runner:
    host = build_host()
    cfg = parse_recipe([TINY_DANCE], [*LIKELIHOOD_FREE, *pairs, ("run.output_dir", str(tmp_path / name))], host)
    return Runner(validate(cfg, host), host)


def test_synthetic_advantages_are_within_group_z_scores() -> None:
    from rlpost.testing import sample_rollout

    policy = ToyPolicy()
    policy.setup(torch.device("cpu"))
    rollout = sample_rollout(ToyCleanSampler(), policy, groups=2, samples_per_group=3)
    adv = synthetic_advantages(rollout)
    torch.testing.assert_close(adv.samples, torch.tensor([-1.0, 0.0, 1.0, -1.0, 0.0, 1.0]))
    assert not bool(adv.edges.any())
    single = sample_rollout(ToyCleanSampler(), policy, groups=2, samples_per_group=1)
    torch.testing.assert_close(synthetic_advantages(single).samples, torch.ones(2))  # never all zero


def test_the_recording_backend_trains_nothing() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    backend = RecordingBackend()
    backend.backward((weight * 2).sum())
    backend.backward(weight.sum() * float("nan"))
    assert backend.step() == {} and backend.steps == 1
    assert backend.losses[0] == 6.0 and backend.losses[1] != backend.losses[1]
    assert weight.grad is None and torch.equal(weight, torch.ones(3))


def test_an_eager_equal_speedup_passes_and_is_logged(tmp_path: Path) -> None:
    runner = _runner(tmp_path, [("run.speedups.attention_backend", "_native_math"), ("run.max_steps", "1")])
    history = runner.run()
    check = runner.ratio_check
    assert isinstance(check, LossCheck) and check.passed  # a likelihood-free rule: the loss guard, not the ratio's
    assert check.losses == 2 and check.reference_loss != 0 and check.error <= 1e-5  # fp32 kernels: measured 9e-7
    assert history[0]["accelerate/loss_error"] == check.error
    assert "accelerate/ratio_error" not in history[0]


def test_train_refuses_a_speedup_that_changes_the_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rlpost.apps import cli

    out = tmp_path / "run"
    args = ["train", "--recipe", TINY_DANCE, "--run.output_dir", str(out)]
    for key, value in [*LIKELIHOOD_FREE, *BF16_TRAIN]:
        args += [f"--{key}", value]
    assert cli.main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "run.speedups: the speed-ups ['autocast=bfloat16 (train)'] change the update rule's loss" in err
    assert "> run.speedups.loss_tolerance = 0.001" in err and "Traceback" not in err
    assert not (out / "metrics.jsonl").exists()


def test_the_loss_tolerance_decides(tmp_path: Path) -> None:
    runner = _runner(tmp_path, [*BF16_TRAIN, ("run.speedups.loss_tolerance", "0.5")])
    runner.setup()
    check = runner.ratio_check
    assert isinstance(check, LossCheck) and 1e-3 < check.error <= 0.5


def _state(runner: Runner) -> dict[str, Any]:
    r = runner.recipe
    assert runner.stream is not None and runner.copies is not None
    return {
        "rollout_gen": runner.rollout_gen.get_state(),
        "minibatch_gen": runner.minibatch_gen.get_state(),
        "global": torch.random.get_rng_state(),
        "weights": [p.detach().clone() for p in r.model.trainable_parameters()],
        "copies": runner.copies.state_dict(),
        "stream": runner.stream.state_dict(),
        "sampler": r.sampler.state_dict(),
        "cached_prompts": len(r.model._cache),  # type: ignore[attr-defined]
    }


def test_the_loss_guard_leaves_the_run_as_it_found_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every RNG stream, the weights, the weight copies, the prompt stream, the sampler state and the prompt cache are
    as without the guard, so the first step trains the same."""
    pairs = [("run.speedups.attention_backend", "_native_math")]
    guarded = _runner(tmp_path, pairs, name="guarded")
    guarded.setup()
    assert isinstance(guarded.ratio_check, LossCheck)
    monkeypatch.setattr(runner_module, "check_speedups", lambda *args: None)
    unguarded = _runner(tmp_path, pairs, name="unguarded")
    unguarded.setup()
    a, b = _state(guarded), _state(unguarded)
    for key in ("rollout_gen", "minibatch_gen", "global"):
        assert torch.equal(a.pop(key), b.pop(key)), key
    for x, y in zip(a.pop("weights"), b.pop("weights"), strict=True):
        assert torch.equal(x, y)
    copies_a, copies_b = a.pop("copies"), b.pop("copies")
    assert copies_a.keys() == copies_b.keys() == {"old"}
    assert all(torch.equal(copies_a["old"][k], copies_b["old"][k]) for k in copies_a["old"])
    assert a == b and a["cached_prompts"] == 0
    rewards = [r.step()["reward/toy-brightness"] for r in (guarded, unguarded)]
    assert abs(rewards[0] - rewards[1]) <= FP32_ATOL
