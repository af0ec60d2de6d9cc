"""``check_advantage_estimator``: an :class:`~rlpost.core.api.AdvantageEstimator` against its contract.

The runner hands an estimator the gathered rollout and the per-source scores and trains on what it returns, so:

* it returns :class:`~rlpost.core.api.Advantages`: ``samples`` ``[S]`` finite floats, ``edges`` ``[E]`` finite
  floats, **zero on every non-trainable edge** (those edges get no gradient, and a value there would be a silent bug),
  ``metrics`` a dict of floats;
* scores that differ within every group give some sample a non-zero advantage (what a likelihood-free rule weights
  its loss by), and, when the rollout has trainable edges (a sampler with ``edge-log-probs``), some trainable edge a
  non-zero advantage (what a policy-gradient rule trains on): each carries the signal. A rollout without trainable
  edges (a ``clean-samples``-only sampler's) needs no edge signal: its edge advantages are all zero by the rule above;
* it mutates neither the rollout nor the scores (hooks and the logger read them afterwards);
* it is deterministic: restoring its state and estimating again gives the same advantages (one process,
  ``docs/design.md`` "Determinism"); its state is pickle-free and survives ``load_state_dict(state_dict())``.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from rlpost.core.api import AdvantageEstimator, Advantages
from rlpost.core.contract import RewardScores, Rollout
from rlpost.core.plugin_errors import check_saveable
from rlpost.testing.inputs import sample_scores
from rlpost.testing.violations import Checker, same_state, snapshot

__all__ = ["check_advantage_estimator"]


def check_advantage_estimator(
    estimator: AdvantageEstimator, rollout: Rollout, scores: RewardScores | None = None
) -> Advantages | None:
    """Check ``estimator`` against the estimator contract (the module docstring lists the rules).

    Args:
        estimator: The estimator under check (stateful estimators see two calls; their state is restored between).
        rollout: A rollout of a sampler that provides what ``estimator.requires``
            (:func:`rlpost.testing.sample_rollout`).
        scores: Reward scores of the rollout's samples; default :func:`rlpost.testing.sample_scores`, distinct per
            sample.

    Returns:
        The advantages of the first call, or ``None`` when there were none.

    Raises:
        ConformanceError: Listing every broken rule.
    """
    check = Checker("advantage estimator", estimator)
    scores = sample_scores(rollout) if scores is None else scores
    before = snapshot(rollout, scores)
    state = check.call("state_dict()", estimator.state_dict)
    if state is not None:
        problem = check_saveable(state)
        check.expect(problem is None, f"state_dict() cannot be checkpointed without pickle: {problem}")
    advantages = check.call("estimate()", estimator.estimate, rollout, scores)
    check.expect(same_state(snapshot(rollout, scores), before), "estimate() changed the rollout or scores in place")
    if advantages is None:
        check.done()
        return None
    if not check.expect(
        isinstance(advantages, Advantages), f"estimate() returned {type(advantages).__name__}, not Advantages"
    ):
        check.done()
        return None
    _check_values(check, advantages, rollout)
    if state is not None:
        after = estimator.state_dict()
        if check.ran("load_state_dict()", estimator.load_state_dict, state):
            again = check.call("estimate()", estimator.estimate, rollout, scores)
            if isinstance(again, Advantages):
                check.expect(
                    same_state(again.edges, advantages.edges) and same_state(again.samples, advantages.samples),
                    "estimate() after restoring the state gives other advantages (not deterministic, or state_dict() "
                    "misses state)",
                )
                check.expect(same_state(estimator.state_dict(), after), "the restored estimator ends in another state")
    check.done()
    return advantages


def _check_values(check: Checker, advantages: Advantages, rollout: Rollout) -> None:
    e, s = rollout.num_edges, rollout.num_samples
    edges, samples = advantages.edges, advantages.samples
    if check.expect(
        isinstance(edges, Tensor) and edges.shape == (e,) and edges.is_floating_point(),
        f"Advantages.edges must be a [{e}] float tensor, got {_shape(edges)}",
    ):
        check.expect(bool(torch.isfinite(edges).all()), "Advantages.edges holds non-finite values")
        frozen = ~rollout.trainable.to(edges.device)
        stray = int((edges[frozen] != 0).sum())
        check.expect(stray == 0, f"{stray} non-trainable edge(s) have a non-zero advantage (must be 0)")
        if bool(rollout.trainable.any()):  # only policy-gradient rollouts have edges to carry the signal
            trained = edges[rollout.trainable.to(edges.device)]
            check.expect(
                bool((trained != 0).any()),
                "every trainable edge has advantage 0 although the scores differ within every group (no signal)",
            )
    if check.expect(
        isinstance(samples, Tensor) and samples.shape == (s,) and samples.is_floating_point(),
        f"Advantages.samples must be a [{s}] float tensor, got {_shape(samples)}",
    ):
        check.expect(bool(torch.isfinite(samples).all()), "Advantages.samples holds non-finite values")
        check.expect(
            bool((samples != 0).any()),
            "every sample has advantage 0 although the scores differ within every group (no signal for a "
            "likelihood-free rule)",
        )
    metrics = advantages.metrics
    if check.expect(isinstance(metrics, dict), f"Advantages.metrics must be a dict, got {type(metrics).__name__}"):
        bad = [k for k, v in metrics.items() if not isinstance(k, str) or not _real(v)]
        check.expect(not bad, f"Advantages.metrics values must be floats under str names: {bad}")


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _shape(value: object) -> str:
    if isinstance(value, Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__
