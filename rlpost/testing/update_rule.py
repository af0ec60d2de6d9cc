"""``check_update_rule``: a :class:`~rlpost.core.api.PolicyOptimizer` (policy-update rule) against its contract,
on a real (tiny) policy, a real sampler's rollout and the engine's single-process backend (``LocalBackend``).

What the runner's guards and the cost accounting rely on:

* ``update`` returns a complete :class:`~rlpost.core.api.UpdateResult` (``rlpost.core.api.update_result_problems``);
* its counts are true: ``train_forwards + reference_forwards`` denoiser rows ran (``Policy.forward_count``), every
  trainable edge was trained, ``train_forwards`` is ``StepCounts.train_forwards * inner_epochs`` and
  ``reference_forwards`` is ``train_forwards * reference_forwards_per_train_forward()`` (the cost models'
  formulas), and nothing was non-finite on finite inputs;
* given non-zero advantages it steps the backend and changes the trainable weights, which stay finite; its metrics
  are namespaced floats; it changes neither the rollout nor the advantages;
* a non-finite loss never reaches the weights and is always counted: with log-probs made NaN the weights stay as
  they were and ``UpdateResult.nonfinite_losses`` plus the losses the backend refused is positive (a rule that
  skipped them silently would switch the loss guard off).

The policy's trainable weights are restored afterwards, so one policy can serve several checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from rlpost.core.api import (
    Advantages,
    EdgeEval,
    Policy,
    PolicyOptimizer,
    Sampler,
    StepCounts,
    UpdateContext,
    UpdateResult,
    update_result_problems,
)
from rlpost.core.contract import Rollout
from rlpost.engine.backend import LocalBackend
from rlpost.testing.inputs import sample_rollout
from rlpost.testing.violations import Checker, same_state, snapshot

__all__ = ["check_update_rule", "signed_advantages"]


def signed_advantages(rollout: Rollout) -> Advantages:
    """Advantages ``+1, -1, +1, ...`` over the trainable edges in order, 0 elsewhere (and ``±1`` per sample): non-zero,
    of both signs, with no estimator involved."""
    edges = torch.zeros(rollout.num_edges)
    trained = rollout.trainable.nonzero().flatten()
    edges[trained] = 1.0 - 2.0 * (torch.arange(trained.numel()) % 2).float()
    samples = 1.0 - 2.0 * (torch.arange(rollout.num_samples) % 2).float()
    return Advantages(edges=edges, samples=samples)


class _NaNLogProbs(Sampler):
    """The sampler under the rule, except that every recomputed log-prob is NaN (still a function of the weights)."""

    name: ClassVar[str] = "conformance-nan-log-probs"

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner

    def rollout(self, policy: Policy, batch: Any, generator: torch.Generator) -> Rollout:
        return self.inner.rollout(policy, batch, generator)

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        out = self.inner.evaluate(policy, rollout, edges)
        return EdgeEval(out.log_prob * float("nan"), out.mean, out.std, out.forwards)

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        return self.inner.counts(num_groups, samples_per_group)


def check_update_rule(
    rule: PolicyOptimizer,
    policy: Policy,
    sampler: Sampler,
    *,
    rollout: Rollout | None = None,
    groups: int = 2,
    samples_per_group: int = 2,
    seed: int = 0,
    lr: float = 1e-2,
) -> UpdateResult | None:
    """Check ``rule`` against the update-rule contract (the module docstring lists the rules).

    Args:
        rule: The update rule under check.
        policy: A set-up policy with trainable parameters (:func:`rlpost.testing.tiny_policy`); its weights are
            restored afterwards.
        sampler: A sampler the rule can train on (it provides the rollout and ``evaluate``).
        rollout: The rollout to train on; default one step of ``sampler`` (:func:`rlpost.testing.sample_rollout`).
        groups: Prompt groups of the default rollout.
        samples_per_group: Samples per group of the default rollout.
        seed: Seed of the rollout and of the minibatch generator.
        lr: SGD learning rate of the backend's torch optimizer.

    Returns:
        The result of the update on finite inputs, or ``None`` when there was none.

    Raises:
        ConformanceError: Listing every broken rule.
    """
    check = Checker("update rule", rule)
    params = policy.trainable_parameters()
    if not check.expect(bool(params), "the policy given to check_update_rule has no trainable parameters"):
        check.done()  # raises: nothing could be trained
    start = [p.detach().clone() for p in params]
    if rollout is None:
        rollout = sample_rollout(sampler, policy, groups, samples_per_group, seed)
    run = _Run(check, rule, policy, sampler, rollout, signed_advantages(rollout), params, seed, lr)
    try:
        result = _check_finite_update(run)
        _restore(params, start)
        _check_nonfinite_update(run)
    finally:
        _restore(params, start)
        policy.train(False)
    check.done()
    return result


def _restore(params: list[torch.nn.Parameter], values: list[Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)
            p.grad = None


@dataclass(frozen=True)
class _Run:
    """What every update of one check shares."""

    check: Checker
    rule: PolicyOptimizer
    policy: Policy
    sampler: Sampler
    rollout: Rollout
    advantages: Advantages
    params: list[torch.nn.Parameter]
    seed: int
    lr: float

    def update(self, sampler: Sampler | None = None) -> tuple[UpdateResult | None, LocalBackend, int]:
        """One ``update`` through a fresh ``LocalBackend`` with SGD (through ``sampler`` instead of the run's when
        given); (the result if it is a valid one, the backend, the denoiser rows that ran)."""
        backend = LocalBackend(self.params, torch.optim.SGD(self.params, lr=self.lr), None, max_grad_norm=1.0)
        generator = torch.Generator().manual_seed(self.seed)
        ctx = UpdateContext(self.policy, sampler or self.sampler, self.rollout, self.advantages, backend, generator, 0)
        rows0 = self.policy.forward_count
        result = self.check.call("update()", self.rule.update, ctx)
        rows = self.policy.forward_count - rows0
        if result is None:
            return None, backend, rows
        problems = update_result_problems(result)
        for problem in problems:
            self.check.expect(False, f"update(): {problem}")
        return (None if problems else result), backend, rows


def _check_finite_update(run: _Run) -> UpdateResult | None:
    check, rule, rollout, params = run.check, run.rule, run.rollout, run.params
    before_inputs = snapshot(rollout, run.advantages)
    before = [p.detach().clone() for p in params]
    result, backend, rows = run.update()
    check.expect(same_state(snapshot(rollout, run.advantages), before_inputs), "update() changed its inputs in place")
    if result is None:
        return None
    trainable = int(rollout.trainable.sum())
    check.expect(
        result.trained_edges == trainable, f"trained_edges = {result.trained_edges}, the rollout has {trainable}"
    )
    check.expect(
        rows == result.train_forwards + result.reference_forwards,
        f"{rows} denoiser rows ran, the result reports {result.train_forwards} training + "
        f"{result.reference_forwards} reference forwards",
    )
    per_pass = _train_forwards(check, run.sampler, rollout)
    if per_pass is not None:
        expected = per_pass * rule.inner_epochs
        check.expect(
            result.train_forwards == expected,
            f"train_forwards = {result.train_forwards}, but StepCounts.train_forwards * inner_epochs = {expected} (the "
            "cost models' count)",
        )
    ref = result.train_forwards * rule.reference_forwards_per_train_forward()
    check.expect(
        result.reference_forwards == ref,
        f"reference_forwards = {result.reference_forwards}, but train_forwards * "
        f"reference_forwards_per_train_forward() = {ref}",
    )
    check.expect(result.nonfinite_losses == 0, f"nonfinite_losses = {result.nonfinite_losses} on finite inputs")
    check.expect(backend.refused_losses == 0, f"{backend.refused_losses} non-finite loss(es) passed to backward")
    check.expect(backend.skipped_steps == 0, f"{backend.skipped_steps} optimizer step(s) had non-finite gradients")
    check.expect(backend.num_steps >= 1, "update() never stepped the backend (TrainBackend.step)")
    moved = any(not torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    check.expect(moved, "update() with non-zero advantages left every trainable weight unchanged")
    check.expect(all(bool(torch.isfinite(p).all()) for p in params), "update() made trainable weights non-finite")
    unnamed = [k for k in result.metrics if "/" not in k]
    check.expect(not unnamed, f"metrics must be namespaced ('loss/...', 'train/...'): {unnamed}")
    return result


def _train_forwards(check: Checker, sampler: Sampler, rollout: Rollout) -> int | None:
    """``StepCounts.train_forwards`` of the rollout's step (``None`` when the sampler cannot say)."""
    per_group = int(rollout.num_samples // max(rollout.num_groups, 1))
    counts = check.call("step_counts()", sampler.step_counts, rollout.num_groups, per_group)
    return counts.train_forwards if isinstance(counts, StepCounts) else None


def _check_nonfinite_update(run: _Run) -> None:
    check, params = run.check, run.params
    before = [p.detach().clone() for p in params]
    result, backend, _ = run.update(_NaNLogProbs(run.sampler))
    unchanged = all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    check.expect(unchanged, "with NaN log-probs, update() changed the weights (a non-finite loss reached them)")
    if result is None:
        return
    counted = result.nonfinite_losses + backend.refused_losses
    check.expect(
        counted > 0,
        "with NaN log-probs, neither UpdateResult.nonfinite_losses nor the backend counted a non-finite loss (the loss "
        "guard would never trip)",
    )
