"""``check_update_rule``: a :class:`~rlpost.core.api.PolicyOptimizer` (policy-update rule) against its contract,
on a real (tiny) policy, a real sampler's rollout, the engine's single-process backend (``LocalBackend``) and the
engine's weight copies (``EngineCopies``, one per name in ``required_copies()``, default schedule, starting equal to
the live weights as a run's do).

What the runner's guards and the cost accounting rely on, for every rule:

* the sampler provides what the rule ``requires`` (else ``rlpost validate`` refuses the pairing and nothing else is
  checked); ``required_copies()`` are valid copy names and ``rollout_copy(step)`` names one of them (or none);
* ``update`` returns a complete :class:`~rlpost.core.api.UpdateResult` (``rlpost.core.api.update_result_problems``);
* its counts are what the rule says it costs, :meth:`PolicyOptimizer.train_counts` of the step's
  ``Sampler.step_counts`` (the formula ``rlpost validate`` prints and the bench's cost model uses):
  ``train_forwards == grad_rows``, ``reference_forwards == nograd_total``, the split by copy (``copy_forwards``, or
  all of it the reference's when empty) equals ``nograd_rows``, and ``Policy.forward_count`` moved by exactly
  ``grad_rows + nograd_total`` (also ``train_forwards + reference_forwards``); a rule that requires
  ``edge-log-probs`` trained every trainable edge, any other trained no more edges than there are;
* on finite inputs nothing was non-finite; given non-zero advantages (:func:`signed_advantages`) it steps the
  backend and changes the trainable weights, which stay finite; its metrics are namespaced floats; it changes neither
  the rollout nor the advantages.

A non-finite loss never reaches the weights and is always counted. What is planted to make the loss non-finite
follows what the rule requires, because that is the input every correct rule of the kind computes its loss from:

* ``edge-log-probs``: every log-prob ``evaluate`` recomputes is NaN (still a function of the weights);
* ``clean-samples``: every clean latent (``Rollout.states[sample_node]``) is NaN. A likelihood-free rule re-noises
  these latents and regresses towards targets built from them, so every loss it computes is NaN, whatever its
  weighting or extra terms.

Either way the weights must stay as they were and ``UpdateResult.nonfinite_losses`` plus the losses the backend
refused must be positive (a rule that skipped them silently would switch the loss guard off). What is deliberately
*not* checked: that zero advantages leave the weights unchanged. That holds only for a loss that is a sum of
advantage-weighted terms (the clipped surrogate without KL); a likelihood-free rule's regulariser (AWM's KL to an
EMA copy, DiffusionNFT's implicit negative policy) moves the weights at zero advantage, correctly.

The policy's trainable weights are restored afterwards, so one policy can serve several checks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from rlpost.core.api import (
    CLEAN_SAMPLES,
    EDGE_LOG_PROBS,
    LIVE,
    REFERENCE,
    Advantages,
    EdgeEval,
    Policy,
    PolicyOptimizer,
    Sampler,
    StepCounts,
    TrainCounts,
    UpdateContext,
    UpdateResult,
    missing_capabilities,
    update_result_problems,
)
from rlpost.core.contract import Rollout
from rlpost.engine.backend import LocalBackend
from rlpost.engine.weight_copies import COPY_NAME, CopyConfig, EngineCopies
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

    def step_counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        return self.inner.step_counts(num_groups, samples_per_group)


def _nan_clean_samples(rollout: Rollout) -> Rollout:
    """``rollout`` with every sample node's state NaN (the other nodes as they were)."""
    states = rollout.states.clone()
    states[rollout.sample_node] = float("nan")
    return replace(rollout, states=states)


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
        sampler: A sampler that provides what ``rule.requires`` (it provides the rollout, and ``evaluate`` for a
            policy-gradient rule).
        rollout: The rollout to train on; default one step of ``sampler`` (:func:`rlpost.testing.sample_rollout`).
        groups: Prompt groups of the default rollout.
        samples_per_group: Samples per group of the default rollout.
        seed: Seed of the rollout, of the minibatch generator and the run seed the rule sees (``UpdateContext.seed``).
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
    requires = frozenset(rule.requires)
    missing = missing_capabilities(sampler.provides, requires)
    if not check.expect(
        not missing,
        f"requires {missing} (PolicyOptimizer.requires = {sorted(requires)}), which sampler "
        f"{sampler.name or type(sampler).__name__!r} does not provide ({sorted(sampler.provides)}): rlpost validate "
        "refuses the pairing (docs/writing_plugins.md, 'Capabilities'); check the rule with a sampler that provides it",
    ):
        check.done()  # raises: the rule cannot run on this sampler's rollouts
    copies = _copy_names(check, rule)
    start = [p.detach().clone() for p in params]
    if rollout is None:
        rollout = sample_rollout(sampler, policy, groups, samples_per_group, seed)
    expected = _train_counts(check, rule, sampler, rollout, copies)
    run = _Run(check, rule, policy, sampler, rollout, signed_advantages(rollout), params, copies, expected, seed, lr)
    try:
        result = _check_finite_update(run)
        if EDGE_LOG_PROBS in requires:
            _restore(params, start)
            _check_nonfinite_update(run, "NaN log-probs", sampler=_NaNLogProbs(sampler))
        if CLEAN_SAMPLES in requires:
            _restore(params, start)
            _check_nonfinite_update(run, "NaN clean samples", rollout=_nan_clean_samples(rollout))
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


def _copy_names(check: Checker, rule: PolicyOptimizer) -> frozenset[str]:
    """The copies ``rule`` needs besides the reference (valid names only), after checking ``rollout_copy``."""
    required = check.call("required_copies()", rule.required_copies)
    if required is None:
        return frozenset()
    names = frozenset(required) - {REFERENCE}
    bad = sorted(n for n in names if not isinstance(n, str) or n == LIVE or not COPY_NAME.match(n))
    check.expect(
        not bad,
        f"required_copies() names {bad}: a copy name is lower-case letters, digits, '_' or '-' and not {LIVE!r} (no "
        "recipe could declare it)",
    )
    usable = {REFERENCE, LIVE, *names}
    for step in (0, 1, 1000):
        chosen = check.call(f"rollout_copy({step})", rule.rollout_copy, step)
        check.expect(
            chosen is None or chosen in usable,
            f"rollout_copy({step}) = {chosen!r} names no weight copy the rule declares (required_copies() = "
            f"{sorted(names)}; the recipe declares only those)",
        )
    return frozenset(n for n in names if n not in bad)


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
    copies: frozenset[str]
    expected: TrainCounts | None
    seed: int
    lr: float

    def update(
        self, sampler: Sampler | None = None, rollout: Rollout | None = None
    ) -> tuple[UpdateResult | None, LocalBackend, int]:
        """One ``update`` through a fresh ``LocalBackend`` with SGD and fresh weight copies equal to the live weights
        (through ``sampler`` / on ``rollout`` instead of the run's when given); (the result if it is a valid one, the
        backend, the denoiser rows that ran)."""
        backend = LocalBackend(self.params, torch.optim.SGD(self.params, lr=self.lr), None, max_grad_norm=1.0)
        generator = torch.Generator().manual_seed(self.seed)
        copies = EngineCopies(self.policy, self.params, {name: CopyConfig() for name in sorted(self.copies)})
        ctx = UpdateContext(
            self.policy,
            sampler or self.sampler,
            rollout or self.rollout,
            self.advantages,
            backend,
            generator,
            0,
            copies,
            self.seed,
        )
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
    check, rollout, params = run.check, run.rollout, run.params
    before_inputs = snapshot(rollout, run.advantages)
    before = [p.detach().clone() for p in params]
    result, backend, rows = run.update()
    check.expect(same_state(snapshot(rollout, run.advantages), before_inputs), "update() changed its inputs in place")
    if result is None:
        return None
    trainable = int(rollout.trainable.sum())
    if EDGE_LOG_PROBS in run.rule.requires:
        check.expect(
            result.trained_edges == trainable, f"trained_edges = {result.trained_edges}, the rollout has {trainable}"
        )
    else:
        check.expect(
            result.trained_edges <= trainable,
            f"trained_edges = {result.trained_edges}, but the rollout has only {trainable} trainable edges",
        )
    check.expect(
        rows == result.train_forwards + result.reference_forwards,
        f"{rows} denoiser rows ran, the result reports {result.train_forwards} training + "
        f"{result.reference_forwards} reference forwards",
    )
    _check_train_counts(run, result, rows)
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


def _train_counts(
    check: Checker, rule: PolicyOptimizer, sampler: Sampler, rollout: Rollout, copies: frozenset[str]
) -> TrainCounts | None:
    """``rule.train_counts`` of the rollout's ``step_counts`` (``None`` when either cannot say), its copies checked
    against ``required_copies()``."""
    per_group = int(rollout.num_samples // max(rollout.num_groups, 1))
    counts = check.call("step_counts()", sampler.step_counts, rollout.num_groups, per_group)
    if not isinstance(counts, StepCounts):
        return None
    expected = check.call("train_counts()", rule.train_counts, counts)
    if not check.expect(
        isinstance(expected, TrainCounts), f"train_counts() must return rlpost.TrainCounts, got {type(expected)}"
    ):
        return None
    assert isinstance(expected, TrainCounts)
    strays = sorted({k for k, v in expected.nograd_rows.items() if v} - {REFERENCE} - copies)
    check.expect(
        not strays,
        f"train_counts().nograd_rows names copies {strays} that required_copies() does not declare",
    )
    return expected


def _check_train_counts(run: _Run, result: UpdateResult, rows: int) -> None:
    """The result's counts and the rows that ran against ``rule.train_counts(step_counts)``."""
    check, expected = run.check, run.expected
    if expected is None:
        return
    nograd = {k: int(v) for k, v in expected.nograd_rows.items() if v}
    check.expect(
        result.train_forwards == expected.grad_rows,
        f"train_forwards = {result.train_forwards}, but train_counts().grad_rows = {expected.grad_rows} (what rlpost "
        "validate prints and the cost models count)",
    )
    check.expect(
        result.reference_forwards == expected.nograd_total,
        f"reference_forwards = {result.reference_forwards}, but train_counts().nograd_total = "
        f"{expected.nograd_total} (no-grad rows of every weight copy together)",
    )
    split = dict(result.copy_forwards) or ({REFERENCE: result.reference_forwards} if result.reference_forwards else {})
    split = {k: int(v) for k, v in split.items() if v}
    check.expect(
        split == nograd,
        f"no-grad rows by copy {split} (UpdateResult.copy_forwards; empty: all the reference's) differ from "
        f"train_counts().nograd_rows = {nograd}",
    )
    total = expected.grad_rows + expected.nograd_total
    check.expect(
        rows == total,
        f"{rows} denoiser rows ran (Policy.forward_count), but train_counts() says grad_rows + nograd_total = {total}",
    )


def _check_nonfinite_update(
    run: _Run, planted: str, sampler: Sampler | None = None, rollout: Rollout | None = None
) -> None:
    check, params = run.check, run.params
    before = [p.detach().clone() for p in params]
    result, backend, _ = run.update(sampler, rollout)
    unchanged = all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    check.expect(unchanged, f"with {planted}, update() changed the weights (a non-finite loss reached them)")
    if result is None:
        return
    counted = result.nonfinite_losses + backend.refused_losses
    check.expect(
        counted > 0,
        f"with {planted}, neither UpdateResult.nonfinite_losses nor the backend counted a non-finite loss (the loss "
        "guard would never trip)",
    )
