"""The conformance kit (``rlpost.testing``) can fail: each check passes a conforming component and names the broken
rule of a planted one. The toy components (``tests/toy_components.py``) and the first-party estimator and update rule
are the conforming baselines; each planted component breaks one rule of its kind. (That every registered first-party
component passes: ``tests/meta/test_conformance.py``.)"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any, ClassVar

import pytest
import torch

from rlpost import Advantages, EdgeEval, PromptSource, UpdateContext, UpdateResult
from rlpost.components.clipped_surrogate import ClippedSurrogate
from rlpost.components.group_zscore import GroupZScoreAdvantage
from rlpost.testing import (
    ConformanceError,
    check_advantage_estimator,
    check_policy,
    check_prompt_source,
    check_reward_source,
    check_sampler,
    check_update_rule,
    sample_rollout,
)
from tests.toy_components import ToyChainSampler, ToyMeanReward, ToyPolicy


@pytest.fixture(scope="module")
def policy() -> ToyPolicy:
    policy = ToyPolicy()
    policy.setup(torch.device("cpu"))
    return policy


def _violations(check: Any, *args: Any, **kwargs: Any) -> list[str]:
    with pytest.raises(ConformanceError) as err:
        check(*args, **kwargs)
    assert str(err.value).count("\n  - ") == len(err.value.violations)  # one error lists them all
    return err.value.violations


def _assert_names(violations: list[str], expected: str) -> None:
    assert any(expected in v for v in violations), f"{expected!r} not among {violations}"


def test_the_conforming_baselines_pass(policy):
    sampler = ToyChainSampler()
    check_sampler(sampler, policy)
    check_policy(policy)
    guided = ToyPolicy(guidance_scale=4.5)  # with negative rows: guidance 1.0 must not read them
    guided.setup(torch.device("cpu"))
    check_policy(guided)
    check_reward_source(ToyMeanReward())
    check_update_rule(ClippedSurrogate(clip_range=0.2), policy, sampler)
    check_advantage_estimator(GroupZScoreAdvantage(), _partly_trainable(sampler, policy))
    check_prompt_source(_Prompts([("a cat", {}), ("a dog", {"digit": 3})]))


# ------------------------------------------------------------------------------------------------- samplers


class Miscounting(ToyChainSampler):
    name: ClassVar[str] = "miscounting"

    def step_counts(self, num_groups: int, samples_per_group: int) -> Any:
        return replace(super().counts(num_groups, samples_per_group), images=num_groups * samples_per_group + 1)


class DriftingEvaluate(ToyChainSampler):
    """Recomputes log-probs with another function than the rollout's (XueZeyue/DanceGRPO issue #87)."""

    name: ClassVar[str] = "drifting-evaluate"

    def evaluate(self, policy: Any, rollout: Any, edges: Any) -> EdgeEval:
        out = super().evaluate(policy, rollout, edges)
        return EdgeEval(out.log_prob + 1e-3, out.mean, out.std, out.forwards)


class DetachedEvaluate(ToyChainSampler):
    name: ClassVar[str] = "detached-evaluate"

    def evaluate(self, policy: Any, rollout: Any, edges: Any) -> EdgeEval:
        out = super().evaluate(policy, rollout, edges)
        return EdgeEval(out.log_prob.detach(), out.mean, out.std, out.forwards)


class OwnRandomness(ToyChainSampler):
    """Ignores the generator it is given."""

    name: ClassVar[str] = "own-randomness"
    calls = 0

    def rollout(self, policy: Any, batch: Any, generator: torch.Generator) -> Any:
        self.calls += 1
        return super().rollout(policy, batch, torch.Generator().manual_seed(self.calls))


class OneGeneratorForAllGroups(ToyChainSampler):
    name: ClassVar[str] = "one-generator"

    def rollout_groups(self, policy: Any, batch: Any, generators: Any) -> Any:
        return self.rollout(policy, batch, generators[0])


class ForgetfulState(ToyChainSampler):
    """Keeps a per-step position that ``load_state_dict`` does not restore."""

    name: ClassVar[str] = "forgetful-state"
    position = 0

    def begin_step(self, step: int, generator: torch.Generator) -> None:
        self.position += 1

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}


class PickledState(ToyChainSampler):
    name: ClassVar[str] = "pickled-state"

    def state_dict(self) -> dict[str, Any]:
        return {"window": {1, 2}}


class NaNOldLogProbs(ToyChainSampler):
    name: ClassVar[str] = "nan-old-log-probs"

    def rollout(self, policy: Any, batch: Any, generator: torch.Generator) -> Any:
        out = super().rollout(policy, batch, generator)
        out.old_log_probs[0] = float("nan")
        return out


class Float32LogProbs(ToyChainSampler):
    name: ClassVar[str] = "fp32-log-probs"

    def rollout(self, policy: Any, batch: Any, generator: torch.Generator) -> Any:
        out = super().rollout(policy, batch, generator)
        out.old_log_probs = out.old_log_probs.float()
        return out


@pytest.mark.parametrize(
    ("sampler", "expected"),
    [
        (Miscounting(), "samples, step_counts().images = 5"),
        (Miscounting(), "step_counts().images = 5 exceeds counts().images = 4"),
        (DriftingEvaluate(), "importance ratios off 1"),
        (DetachedEvaluate(), "evaluate().log_prob carries no gradient"),
        (OwnRandomness(), "the same begin_step and rollout generator seeds gave a different rollout"),
        (OneGeneratorForAllGroups(), "old log-probs differ from the group rolled out alone"),
        (OneGeneratorForAllGroups(), "rollout_groups() with one generator too few did not raise ValueError"),
        (ForgetfulState(), "load_state_dict(state_dict()) does not restore the state"),
        (PickledState(), "state_dict() cannot be checkpointed without pickle"),
        (NaNOldLogProbs(), "trainable edge(s) have a non-finite old log-prob"),
        (Float32LogProbs(), "old_log_probs must be fp64"),
    ],
    ids=lambda x: x.name if hasattr(x, "name") else "",
)
def test_check_sampler_names_the_broken_rule(policy, sampler, expected):
    _assert_names(_violations(check_sampler, sampler, policy), expected)


# ----------------------------------------------------------------------------------------------- estimators


def _partly_trainable(sampler: ToyChainSampler, policy: ToyPolicy) -> Any:
    rollout = sample_rollout(sampler, policy, groups=2, samples_per_group=3)
    rollout.trainable[::3] = False  # non-trainable edges must get advantage 0
    return rollout


class InPlace(GroupZScoreAdvantage):
    def estimate(self, rollout: Any, scores: Any) -> Advantages:
        for values in scores.scores.values():
            values.mul_(2.0)
        return super().estimate(rollout, scores)


class LeakyFrozenEdges(GroupZScoreAdvantage):
    def estimate(self, rollout: Any, scores: Any) -> Advantages:
        out = super().estimate(rollout, scores)
        return Advantages(out.edges + 0.5 * (~rollout.trainable).float(), out.samples, out.metrics)


class NaNAdvantages(GroupZScoreAdvantage):
    def estimate(self, rollout: Any, scores: Any) -> Advantages:
        out = super().estimate(rollout, scores)
        out.edges[rollout.trainable.nonzero()[0]] = float("nan")
        return out


class Silent(GroupZScoreAdvantage):
    def estimate(self, rollout: Any, scores: Any) -> Advantages:
        out = super().estimate(rollout, scores)
        return Advantages(torch.zeros_like(out.edges), out.samples, out.metrics)


class HiddenState(GroupZScoreAdvantage):
    """Drifts with a counter its ``state_dict`` does not hold."""

    calls = 0

    def estimate(self, rollout: Any, scores: Any) -> Advantages:
        self.calls += 1
        out = super().estimate(rollout, scores)
        return Advantages(out.edges * self.calls, out.samples, out.metrics)


class ShortEdges(GroupZScoreAdvantage):
    def estimate(self, rollout: Any, scores: Any) -> Advantages:
        out = super().estimate(rollout, scores)
        return Advantages(out.edges[:-1], out.samples, {"adv/x": "high"})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        (InPlace(), "estimate() changed the rollout or scores in place"),
        (LeakyFrozenEdges(), "non-trainable edge(s) have a non-zero advantage"),
        (NaNAdvantages(), "Advantages.edges holds non-finite values"),
        (Silent(), "every trainable edge has advantage 0"),
        (HiddenState(), "estimate() after restoring the state gives other advantages"),
        (ShortEdges(), "Advantages.edges must be a [18] float tensor"),
        (ShortEdges(), "Advantages.metrics values must be floats"),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, str) else "",
)
def test_check_advantage_estimator_names_the_broken_rule(policy, estimator, expected):
    rollout = _partly_trainable(ToyChainSampler(), policy)
    _assert_names(_violations(check_advantage_estimator, estimator, rollout), expected)


# -------------------------------------------------------------------------------------------------- rewards


class BatchRelative(ToyMeanReward):
    """Scores relative to the batch mean: a sample's reward depends on its batch mates."""

    def score(self, images: Any, prompts: Any, metadata: Any) -> Any:
        s = super().score(images, prompts, metadata)
        return s - s.mean()


class Noisy(ToyMeanReward):
    def score(self, images: Any, prompts: Any, metadata: Any) -> Any:
        return super().score(images, prompts, metadata) + 1e-3 * torch.rand(images.shape[0])


class IntegerScores(ToyMeanReward):
    def score(self, images: Any, prompts: Any, metadata: Any) -> Any:
        return images.sum(dim=(1, 2, 3))


class NaNScores(ToyMeanReward):
    def score(self, images: Any, prompts: Any, metadata: Any) -> Any:
        return super().score(images, prompts, metadata) * float("nan")


class Scribbler(ToyMeanReward):
    def score(self, images: Any, prompts: Any, metadata: Any) -> Any:
        out = super().score(images, prompts, metadata)
        images[:, 0, 0] = 0
        return out


class BrokenSetup(ToyMeanReward):
    def setup(self, device: torch.device) -> None:
        raise FileNotFoundError("weights.bin")


@pytest.mark.parametrize(
    ("reward", "expected"),
    [
        (BatchRelative(), "scores depend on the batch"),
        (Noisy(), "score() of the same inputs gave other scores"),
        (IntegerScores(), "score() must return a [4] floating-point tensor, got torch.int64"),
        (NaNScores(), "score() returned non-finite scores"),
        (Scribbler(), "score() changed its inputs in place"),
        (BrokenSetup(), "setup() raised FileNotFoundError: weights.bin"),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, str) else "",
)
def test_check_reward_source_names_the_broken_rule(reward, expected):
    _assert_names(_violations(check_reward_source, reward), expected)


# --------------------------------------------------------------------------------------------- update rules


class ReturnsMetrics(ClippedSurrogate):
    def update(self, ctx: UpdateContext) -> Any:
        return super().update(ctx).metrics


class Overcounting(ClippedSurrogate):
    def update(self, ctx: UpdateContext) -> Any:
        result = super().update(ctx)
        return replace(result, train_forwards=result.train_forwards + 1)


class SwallowsNaN(ClippedSurrogate):
    """Skips non-finite losses (they never reach backward) but reports none: the loss guard could never trip."""

    def update(self, ctx: UpdateContext) -> Any:
        return replace(super().update(ctx), nonfinite_losses=0)


class NeverSteps(ClippedSurrogate):
    def update(self, ctx: UpdateContext) -> Any:
        edges = ctx.rollout.trainable.nonzero().flatten()
        forwards = ctx.sampler.evaluate(ctx.policy, ctx.rollout, edges).forwards
        return UpdateResult(
            trained_edges=int(edges.numel()), train_forwards=forwards, reference_forwards=0, nonfinite_losses=0
        )


class ScalesAdvantages(ClippedSurrogate):
    def update(self, ctx: UpdateContext) -> Any:
        ctx.advantages.edges.mul_(2.0)
        return super().update(ctx)


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        (ReturnsMetrics(clip_range=0.2), "update(): returned a dict of metrics, expected rlpost.UpdateResult"),
        (Overcounting(clip_range=0.2), "denoiser rows ran, the result reports"),
        (SwallowsNaN(clip_range=0.2), "neither UpdateResult.nonfinite_losses nor the backend counted"),
        (NeverSteps(clip_range=0.2), "update() never stepped the backend"),
        (NeverSteps(clip_range=0.2), "left every trainable weight unchanged"),
        (ScalesAdvantages(clip_range=0.2), "update() changed its inputs in place"),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, str) else "",
)
def test_check_update_rule_names_the_broken_rule(policy, rule, expected):
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    _assert_names(_violations(check_update_rule, rule, policy, ToyChainSampler()), expected)
    after = policy.trainable_parameters()
    assert all(torch.allclose(a, b) for a, b in zip(after, before, strict=True))  # the check restores the weights


# ------------------------------------------------------------------------------------------------- policies


class Uncounted(ToyPolicy):
    def velocity(self, latents: Any, sigma: Any, cond: Any, guidance: Any = None) -> Any:
        out = super().velocity(latents, sigma, cond, guidance)
        self.forward_count -= latents.shape[0]
        return out


class BatchMixing(ToyPolicy):
    def velocity(self, latents: Any, sigma: Any, cond: Any, guidance: Any = None) -> Any:
        return super().velocity(latents, sigma, cond, guidance) - latents.mean(0)


class NoGuidanceArgument(ToyPolicy):
    """The contract before per-call guidance: ``velocity(latents, sigma, cond)``."""

    def velocity(self, latents: Any, sigma: Any, cond: Any) -> Any:  # type: ignore[override]
        return super().velocity(latents, sigma, cond)


class CFGAlways(ToyPolicy):
    """Configured with CFG, applies it whatever the call asks: guidance 1.0 still reads the negative rows."""

    def __init__(self) -> None:
        super().__init__(guidance_scale=4.5)

    def velocity(self, latents: Any, sigma: Any, cond: Any, guidance: Any = None) -> Any:
        return super().velocity(latents, sigma, cond)


class LeakyConditional(ToyPolicy):
    """Guidance 1.0 mixes a little of the negative branch in whenever the conditioning has one."""

    def __init__(self) -> None:
        super().__init__(guidance_scale=4.5)

    def velocity(self, latents: Any, sigma: Any, cond: Any, guidance: Any = None) -> Any:
        out = super().velocity(latents, sigma, cond, guidance)
        if guidance == 1.0 and "negative_bias" in cond.tensors:
            out = out + 0.1 * cond.tensors["negative_bias"].view(-1, 1, 1, 1)
        return out


class NoneIsUnguided(ToyPolicy):
    """``guidance=None`` turns guidance off instead of meaning the configured scale."""

    def __init__(self) -> None:
        super().__init__(guidance_scale=4.5)

    def velocity(self, latents: Any, sigma: Any, cond: Any, guidance: Any = 4.5) -> Any:
        return super().velocity(latents, sigma, cond, 1.0 if guidance is None else guidance)


class GuidanceUnchecked(ToyPolicy):
    """Takes any guidance: below 1 silently, and above 1 without negative rows fails with a KeyError."""

    def velocity(self, latents: Any, sigma: Any, cond: Any, guidance: Any = None) -> Any:
        out = super().velocity(latents, sigma, cond)
        if guidance is not None and guidance > 1.0:
            out = out + cond.tensors["negative_bias"].view(-1, 1, 1, 1)
        return out


class RisingSigmas(ToyPolicy):
    def sigmas(self, num_steps: int) -> Any:
        return torch.linspace(0.0, 1.0, num_steps + 1)


class FixedNoise(ToyPolicy):
    def initial_noise(self, num: int, generator: torch.Generator) -> Any:
        return torch.ones((num, 1, 2, 2))


class Frozen(ToyPolicy):
    def trainable_parameters(self) -> Any:
        return []


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (Uncounted, "velocity() of 2 rows added 0 to forward_count"),
        (BatchMixing, "velocity() depends on the batch"),
        (RisingSigmas, "sigmas must run from 1 down to 0"),
        (FixedNoise, "initial_noise() ignores its generator"),
        (Frozen, "trainable_parameters() is empty"),
        (NoGuidanceArgument, "velocity(guidance=None) raised TypeError"),
        (CFGAlways, "velocity(guidance=1.0) without the negative_* tensors raised KeyError"),
        (LeakyConditional, "velocity(guidance=1.0) depends on the negative-prompt rows"),
        (NoneIsUnguided, "velocity(guidance=None) differs from velocity() without it"),
        (GuidanceUnchecked, "velocity(guidance=0.5) must raise ValueError (below 1 or not finite), but it returned"),
        (GuidanceUnchecked, "velocity(guidance=2.0) without negative-prompt rows must apply the scale or raise"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else "",
)
def test_check_policy_names_the_broken_rule(cls, expected):
    planted = cls()
    planted.setup(torch.device("cpu"))
    _assert_names(_violations(check_policy, planted), expected)


# -------------------------------------------------------------------------------------------- prompt sources


class _Prompts(PromptSource):
    name: ClassVar[str] = "planted-prompts"

    def __init__(self, items: Any, shuffle: bool = False) -> None:
        self.items, self.shuffle = items, shuffle

    def load(self) -> Any:
        items = list(self.items)
        if self.shuffle:
            random.Random().shuffle(items)
        return items


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (_Prompts([]), "load() must return a non-empty list"),
        (_Prompts([("", {}), ("a cat", "meta")]), "items [0, 1] are not (non-empty prompt, metadata dict"),
        (_Prompts([(f"prompt {i}", {}) for i in range(50)], shuffle=True), "two load() calls returned different"),
    ],
    ids=["empty", "bad-items", "shuffled"],
)
def test_check_prompt_source_names_the_broken_rule(source, expected):
    _assert_names(_violations(check_prompt_source, source), expected)
