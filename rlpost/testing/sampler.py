"""``check_sampler``: a :class:`~rlpost.core.api.Sampler` against its contract (``rlpost/core/api/sampler.py``,
``docs/writing_plugins.md``, ``docs/design.md`` "Component interfaces"), on a real (tiny) policy.

What the engine relies on, each rule one violation when broken. Every sampler:

* ``rollout`` returns a valid :class:`~rlpost.core.contract.Rollout` of the batch's groups (uint8
  ``[S, F, H, W, 3]`` media, fp32 states);
* the rollout's images, trainable edges and denoiser rows (``Policy.forward_count``) equal :meth:`Sampler.step_counts`,
  which never exceeds the worst case :meth:`Sampler.counts` (cost models and ``rlpost validate`` print these);
* the same step and generator seeds give the same rollout (one process: ``docs/design.md``, "Determinism");
* ``rollout_groups`` equals each group rolled out alone with its generator, merged (up to batching rounding), and
  refuses a wrong number of generators;
* the state is pickle-free, ``load_state_dict(state_dict())`` restores it, and a restored sampler's next
  ``begin_step`` continues the same per-step sequence (what resuming needs).

What else is checked follows the capabilities the sampler declares (``Sampler.provides``,
:mod:`rlpost.core.api.capabilities`; ``docs/writing_plugins.md``, "Capabilities"):

* ``edge-log-probs``: the sampler overrides :meth:`Sampler.evaluate`; the rollout has at least one trainable edge,
  fp64 old log-probs finite on every trainable edge; ``evaluate`` of the trainable edges before any update reproduces
  them (importance ratio 1 within ``ratio_tol``: ``docs/writing_plugins.md`` allows 1e-6), with gradients reaching
  the trainable parameters, one reported forward per measured one, and as many as ``StepCounts.train_forwards``;
  ``rollout_groups`` gives each group the old log-probs of the group rolled out alone.
* no ``edge-log-probs``: the rollout marks no edge trainable (a policy-gradient rule would train edges whose
  log-probs nobody can recompute; ``rlpost validate`` keeps such rules away from this sampler anyway).
* ``clean-samples``: every sample node sits at noise level 0 (``sigmas[node_step] == 0``) and its state is what was
  decoded (``Policy.decode(states[sample_node])`` equals ``media`` within ``pixel_tol`` levels): a likelihood-free
  rule re-noises exactly these latents; ``rollout_groups`` gives each sample the clean latent of its group rolled
  out alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlpost.core.api import CLEAN_SAMPLES, EDGE_LOG_PROBS, EdgeEval, Policy, Sampler, StepCounts
from rlpost.core.contract import PromptBatch, Rollout
from rlpost.core.merge import merge_rollouts
from rlpost.core.plugin_errors import check_saveable
from rlpost.testing.inputs import prompt_batch
from rlpost.testing.violations import Checker, same_state

__all__ = ["check_sampler"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_sampler(
    sampler: Sampler,
    policy: Policy,
    *,
    groups: int = 2,
    samples_per_group: int = 2,
    seed: int = 0,
    ratio_tol: float = 1e-6,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    pixel_tol: int = 1,
) -> Rollout | None:
    """Check ``sampler`` against the sampler contract (the module docstring lists the rules).

    Args:
        sampler: The sampler under check (its ``begin_step`` is called; its state changes).
        policy: A set-up policy (:func:`rlpost.testing.tiny_policy`); its weights are not changed.
        groups: Prompt groups per rollout.
        samples_per_group: Samples per group.
        seed: Seed of the step and rollout generators.
        ratio_tol: Largest ``|ratio - 1|`` allowed for an unchanged policy.
        rtol: Relative tolerance between batched and one-group rollouts (fp32 batching rounding).
        atol: Absolute tolerance for the same.
        pixel_tol: Largest difference in uint8 levels between batched and one-group images.

    Returns:
        The step-0 rollout (to check an estimator or update rule on), or ``None`` when there was none.

    Raises:
        ConformanceError: Listing every broken rule.
    """
    check = Checker("sampler", sampler)
    provides = _provides(check, sampler)
    edges, clean = EDGE_LOG_PROBS in provides, CLEAN_SAMPLES in provides
    if edges:
        check.expect(
            type(sampler).evaluate is not Sampler.evaluate,
            f"declares {EDGE_LOG_PROBS!r} (Sampler.provides) but does not override evaluate(): a policy-gradient rule "
            "would call the default, which raises NotImplementedError",
        )
    batch = prompt_batch(groups, samples_per_group)
    rollout, rows = _rollout(check, sampler, policy, batch, seed)
    state = check.call("state_dict()", sampler.state_dict)
    counts = _counts(check, sampler, groups, samples_per_group)
    if rollout is not None:
        _check_rollout(check, rollout, batch, counts, rows, edges)
        if edges:
            _check_evaluate(check, sampler, policy, rollout, counts, ratio_tol)
        if clean:
            _check_clean(check, policy, rollout, pixel_tol)
        again, _ = _rollout(check, sampler, policy, batch, seed)
        if again is not None:
            same = all(
                same_state(getattr(rollout, f), getattr(again, f))
                for f in ("media", "states", "old_log_probs", "trainable", "edge_parent", "edge_child", "sample_node")
            )
            check.expect(same, "the same begin_step and rollout generator seeds gave a different rollout")
    _check_groups(check, sampler, policy, (groups, samples_per_group), seed, (rtol, atol, pixel_tol), provides)
    if state is not None:
        _check_state(check, sampler, state, groups, samples_per_group, seed)
    check.done()
    return rollout


def _provides(check: Checker, sampler: Sampler) -> frozenset[str]:
    """``sampler.provides``, when it is a set of capability names (a violation, and nothing provided, otherwise)."""
    provides = getattr(sampler, "provides", None)
    if not check.expect(
        isinstance(provides, frozenset | set) and all(isinstance(c, str) for c in provides),
        f"provides must be a frozenset of capability names (rlpost.core.api.capabilities), got {provides!r}",
    ):
        return frozenset()
    return frozenset(provides)  # type: ignore[arg-type]


def _rollout(
    check: Checker, sampler: Sampler, policy: Policy, batch: PromptBatch, seed: int
) -> tuple[Rollout | None, int]:
    """Step 0's ``begin_step`` and ``rollout``, and the denoiser rows it ran (``Policy.forward_count``)."""
    if not check.ran("begin_step()", sampler.begin_step, 0, _gen(seed)):
        return None, 0
    start = policy.forward_count
    with torch.no_grad():
        rollout = check.call("rollout()", sampler.rollout, policy, batch, _gen(seed + 1))
    rows = policy.forward_count - start
    if rollout is None:
        return None, rows
    if not check.expect(isinstance(rollout, Rollout), f"rollout() returned {type(rollout).__name__}, not a Rollout"):
        return None, rows
    if not check.ran("Rollout.validate()", rollout.validate):
        return None, rows
    return rollout, rows


def _counts(check: Checker, sampler: Sampler, groups: int, per_group: int) -> tuple[StepCounts, StepCounts] | None:
    """(step_counts, counts) of the step ``begin_step`` began, when both are ``StepCounts``."""
    drawn = check.call("step_counts()", sampler.step_counts, groups, per_group)
    worst = check.call("counts()", sampler.counts, groups, per_group)
    if not (isinstance(drawn, StepCounts) and isinstance(worst, StepCounts)):
        check.expect(drawn is None or worst is None, "counts() and step_counts() must return rlpost.StepCounts")
        return None
    for name in ("images", "trainable_edges", "rollout_forwards", "train_forwards"):
        check.expect(
            getattr(drawn, name) <= getattr(worst, name),
            f"step_counts().{name} = {getattr(drawn, name)} exceeds counts().{name} = {getattr(worst, name)} (counts() "
            "is the worst case over the step's draws)",
        )
    expected = check.call("expected_rollout_forwards()", sampler.expected_rollout_forwards, groups, per_group)
    if isinstance(expected, int | float):
        check.expect(
            0 < expected <= worst.rollout_forwards,
            f"expected_rollout_forwards() = {expected} is not in (0, counts().rollout_forwards = "
            f"{worst.rollout_forwards}]",
        )
    return drawn, worst


def _check_rollout(
    check: Checker,
    rollout: Rollout,
    batch: PromptBatch,
    counts: tuple[StepCounts, StepCounts] | None,
    rows: int,
    edges: bool,
) -> None:
    check.expect(rollout.prompts == batch.prompts, "Rollout.prompts differ from the batch's prompts")
    check.expect(rollout.metadata == batch.metadata, "Rollout.metadata differ from the batch's metadata")
    check.expect(rollout.group_offset == batch.group_offset, "Rollout.group_offset differs from the batch's")
    media = rollout.media
    check.expect(media.ndim == 5 and media.shape[-1] == 3, f"media must be [S, F, H, W, 3], got {list(media.shape)}")
    check.expect(rollout.states.dtype == torch.float32, f"states must be fp32, got {rollout.states.dtype}")
    trained = rollout.trainable.nonzero().flatten()
    if edges:
        check.expect(
            rollout.old_log_probs.dtype == torch.float64,
            f"old_log_probs must be fp64 (an fp32 ulp exceeds the PPO clip range), got {rollout.old_log_probs.dtype}",
        )
        check.expect(trained.numel() > 0, "the rollout has no trainable edge: nothing would be trained")
        bad = int((~torch.isfinite(rollout.old_log_probs[trained])).sum())
        check.expect(bad == 0, f"{bad} trainable edge(s) have a non-finite old log-prob")
    else:
        check.expect(
            trained.numel() == 0,
            f"the rollout marks {trained.numel()} edge(s) trainable, but the sampler does not provide "
            f"{EDGE_LOG_PROBS!r}: nothing can recompute their log-probs (declare it and implement evaluate(), or mark "
            "no edge trainable)",
        )
    groups = set(rollout.sample_group.tolist())
    check.expect(groups == set(range(batch.num_groups)), f"samples cover groups {sorted(groups)}, not every group")
    same_group = bool(torch.equal(rollout.sample_group, rollout.node_group[rollout.sample_node]))
    check.expect(same_group, "sample_group differs from the group of each sample's node")
    if counts is None:
        return
    drawn, _ = counts
    check.expect(
        rollout.num_samples == drawn.images, f"{rollout.num_samples} samples, step_counts().images = {drawn.images}"
    )
    check.expect(
        trained.numel() == drawn.trainable_edges,
        f"{trained.numel()} trainable edges, step_counts().trainable_edges = {drawn.trainable_edges}",
    )
    check.expect(
        rows == drawn.rollout_forwards,
        f"rollout() ran {rows} denoiser rows (Policy.forward_count), step_counts().rollout_forwards = "
        f"{drawn.rollout_forwards}",
    )
    if "perf/rollout_forwards" in rollout.stats:
        reported = rollout.stats["perf/rollout_forwards"]
        check.expect(reported == rows, f"stats['perf/rollout_forwards'] = {reported}, but {rows} rows ran")


def _check_evaluate(
    check: Checker,
    sampler: Sampler,
    policy: Policy,
    rollout: Rollout,
    counts: tuple[StepCounts, StepCounts] | None,
    ratio_tol: float,
) -> None:
    edges = rollout.trainable.nonzero().flatten()
    if edges.numel() == 0:
        return
    policy.train(True)  # as the update rule runs it
    start = policy.forward_count
    try:
        evaluation = check.call("evaluate()", sampler.evaluate, policy, rollout, edges)
    finally:
        policy.train(False)
    rows = policy.forward_count - start
    if evaluation is None:
        return
    if not check.expect(isinstance(evaluation, EdgeEval), f"evaluate() returned {type(evaluation).__name__}"):
        return
    lp = evaluation.log_prob
    if not check.expect(
        isinstance(lp, Tensor) and lp.shape == (edges.numel(),),
        f"evaluate().log_prob must be [{edges.numel()}], got {getattr(lp, 'shape', type(lp).__name__)}",
    ):
        return
    check.expect(evaluation.forwards == rows, f"evaluate() reports {evaluation.forwards} forwards, {rows} ran")
    if counts is not None:
        train = counts[0].train_forwards
        check.expect(rows == train, f"evaluate() of every trainable edge ran {rows} rows, train_forwards = {train}")
    dev = float((torch.exp(lp.detach().double() - rollout.old_log_probs[edges].to(lp.device)) - 1).abs().max())
    check.expect(
        dev <= ratio_tol,
        f"evaluate() before any update gives importance ratios off 1 by {dev:.3g} (allowed {ratio_tol:g}): the "
        "log-prob of evaluate() differs from the rollout's",
    )
    mean, std = evaluation.mean, evaluation.std
    check.expect(mean.shape[0] == edges.numel(), f"evaluate().mean must have {edges.numel()} rows")
    try:
        broadcast = std.expand(mean.shape).shape == mean.shape
    except RuntimeError:
        broadcast = False
    check.expect(broadcast, f"evaluate().std {list(std.shape)} does not broadcast to mean {list(mean.shape)}")
    params = [p for p in policy.trainable_parameters() if p.requires_grad]
    if not check.expect(lp.requires_grad and bool(params), "evaluate().log_prob carries no gradient"):
        return
    grads = torch.autograd.grad(lp.sum(), params, allow_unused=True)
    moved = [g for g in grads if g is not None and bool(g.abs().sum() > 0)]
    check.expect(bool(moved), "evaluate().log_prob has no gradient with respect to the trainable parameters")
    check.expect(all(bool(torch.isfinite(g).all()) for g in moved), "evaluate() gives non-finite gradients")


def _check_clean(check: Checker, policy: Policy, rollout: Rollout, pixel_tol: int) -> None:
    """``clean-samples``: each sample node is at noise level 0 and holds the latent its media were decoded from."""
    nodes = rollout.sample_node
    steps = rollout.node_step[nodes]
    inside = bool(((steps >= 0) & (steps < rollout.sigmas.numel())).all())
    if not check.expect(inside, "node_step of a sample node is outside sigmas"):
        return
    noisy = int((rollout.sigmas[steps] != 0).sum())
    check.expect(
        noisy == 0,
        f"{noisy} sample node(s) are not at noise level 0 (sigmas[node_step] != 0), but the sampler provides "
        f"{CLEAN_SAMPLES!r}: a likelihood-free rule would re-noise a noisy latent as if it were clean",
    )
    with torch.no_grad():
        decoded = check.call("Policy.decode(states[sample_node])", policy.decode, rollout.states[nodes])
    if not isinstance(decoded, Tensor):
        return
    media = rollout.media
    if not check.expect(
        decoded.shape == media.shape,
        f"Policy.decode(states[sample_node]) gives {list(decoded.shape)}, the rollout's media are {list(media.shape)}",
    ):
        return
    diff = int((decoded.cpu().int() - media.int()).abs().max()) if media.numel() else 0
    check.expect(
        diff <= pixel_tol,
        f"the media differ from Policy.decode(states[sample_node]) by {diff} levels (allowed {pixel_tol}): the sample "
        f"nodes do not hold the latents that were decoded and scored, but the sampler provides {CLEAN_SAMPLES!r}",
    )


def _check_groups(
    check: Checker,
    sampler: Sampler,
    policy: Policy,
    shape: tuple[int, int],
    seed: int,
    tolerances: tuple[float, float, int],
    provides: frozenset[str],
) -> None:
    """``rollout_groups`` against one ``rollout`` per group with the same generators (offset as on a later rank):
    ``shape`` is (groups, samples per group), ``tolerances`` (rtol, atol, pixel_tol)."""
    groups, per_group = shape
    rtol, atol, pixel_tol = tolerances
    batch = prompt_batch(groups, per_group, group_offset=3)

    def gens() -> list[torch.Generator]:
        return [_gen(seed + 100 + j) for j in range(groups)]

    if not check.ran("begin_step()", sampler.begin_step, 0, _gen(seed)):
        return
    with torch.no_grad():
        together = check.call("rollout_groups()", sampler.rollout_groups, policy, batch, gens())
        parts = []
        for j, g in enumerate(gens()):
            one = PromptBatch([batch.prompts[j]], [batch.metadata[j]], per_group, group_offset=batch.group_offset + j)
            parts.append(check.call("rollout()", sampler.rollout, policy, one, g))
        try:
            sampler.rollout_groups(policy, batch, gens()[:-1])
            refused = False
        except ValueError:
            refused = True
    check.expect(refused, "rollout_groups() with one generator too few did not raise ValueError")
    if not isinstance(together, Rollout) or not all(isinstance(p, Rollout) for p in parts):
        check.expect(together is None or None in parts, "rollout_groups() must return a Rollout")
        return
    alone = merge_rollouts(parts)  # type: ignore[arg-type]
    check.expect(together.group_offset == batch.group_offset, "rollout_groups() lost the batch's group_offset")
    if not check.expect(
        together.sample_group.tolist() == alone.sample_group.tolist(),
        "rollout_groups() gives other samples per group than one rollout() per group",
    ):
        return
    diff = int((together.media.int() - alone.media.int()).abs().max()) if together.media.numel() else 0
    check.expect(diff <= pixel_tol, f"rollout_groups() media differ from per-group rollouts by {diff} levels")
    if CLEAN_SAMPLES in provides:
        a, b = (r.states[r.sample_node] for r in (together, alone))
        check.expect(
            a.shape == b.shape and bool(torch.allclose(a, b, rtol=rtol, atol=atol)),
            "rollout_groups() clean samples (states[sample_node]) differ from the groups rolled out alone",
        )
    if EDGE_LOG_PROBS not in provides:
        return
    for group in range(groups):
        a, b = (_group_log_probs(r, group) for r in (together, alone))
        if not check.expect(
            a.shape == b.shape, f"group {group}: rollout_groups() trains {a.numel()} edges, alone {b.numel()}"
        ):
            continue
        check.expect(
            bool(torch.allclose(a, b, rtol=rtol, atol=atol)),
            f"group {group}: rollout_groups() old log-probs differ from the group rolled out alone",
        )


def _group_log_probs(rollout: Rollout, group: int) -> Tensor:
    """Sorted old log-probs of one group's trainable edges (row order is free)."""
    mask = rollout.trainable & (rollout.node_group[rollout.edge_child] == group)
    return torch.sort(rollout.old_log_probs[mask]).values


def _check_state(
    check: Checker, sampler: Sampler, state: dict[str, object], groups: int, per_group: int, seed: int
) -> None:
    """After step 0's ``begin_step``: pickle-free state, a faithful round trip, and a resumed step 1."""
    problem = check_saveable(state)
    check.expect(problem is None, f"state_dict() cannot be checkpointed without pickle: {problem}")
    if not check.ran("begin_step()", sampler.begin_step, 1, _gen(seed + 7)):
        return
    next_counts = check.call("step_counts()", sampler.step_counts, groups, per_group)
    next_state = check.call("state_dict()", sampler.state_dict)
    if not check.ran("load_state_dict()", sampler.load_state_dict, state):
        return
    check.expect(same_state(sampler.state_dict(), state), "load_state_dict(state_dict()) does not restore the state")
    sampler.begin_step(1, _gen(seed + 7))
    check.expect(
        same_state(sampler.state_dict(), next_state) and sampler.step_counts(groups, per_group) == next_counts,
        "after load_state_dict, the next begin_step gives another per-step state than the uninterrupted sampler "
        "(a resumed run would not continue the sequence)",
    )
