"""The evaluation's scorers: its rewards (``eval.rewards``, default the training rewards) and second judges
(``eval.judges``, scorers the policy is never trained on), checked and applied to a set's images.

A judge's per-prompt column is ``judge/<name>`` and its metric ``eval/[<set>/]judge/<name>``
(:func:`~rlpost.engine.evaluation.keys.metric_key`), so a judge can never be mistaken for a reward of the same name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from rlpost.core.api import RewardSource
from rlpost.engine.evaluation.config import ComponentChecks, EvalSpec
from rlpost.engine.evaluation.keys import JUDGE, metric_key
from rlpost.ops.media import FrameReduction, score_media

__all__ = ["score_set", "validate_judges", "validate_rewards"]


def validate_rewards(
    value: dict[str, Any],
    train_rewards: list[Any],
    built: dict[str, Any],
    checks: ComponentChecks,
    problems: list[str],
    resolved: dict[str, Any],
) -> list[RewardSource]:
    """``eval.rewards`` (default: the training rewards ``train_rewards``, resolved): a non-empty list of reward
    sources; one configured exactly like a training reward shares its instance in ``built["rewards"]`` (its weights
    load once)."""
    rewards_raw = value.get("rewards", train_rewards)
    if not isinstance(rewards_raw, list) or not rewards_raw:
        problems.append("eval.rewards: expected a non-empty list of reward sources")
        rewards_raw = []
    rewards: list[RewardSource] = []
    for i, rv in _resolve_each(rewards_raw, "rewards", checks, problems, resolved):
        shared = [r for r, c in zip(built.get("rewards", []), train_rewards, strict=False) if c == rv]
        if shared:
            rewards.append(shared[0])
            continue
        got = checks.check("rewards", list[RewardSource], [rv], problems, f"eval.rewards[{i}]")
        if got is not None:
            rewards.extend(got)
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        problems.append(
            f"eval.rewards: reward source(s) {sorted({n for n in names if names.count(n) > 1})} listed twice"
        )
    return rewards


def validate_judges(
    value: dict[str, Any],
    built: dict[str, Any],
    eval_reward_names: list[str],
    checks: ComponentChecks,
    problems: list[str],
    resolved: dict[str, Any],
) -> list[RewardSource]:
    """``eval.judges``: reward sources scored at evaluation only; none may be a training or evaluation reward."""
    raw = value.get("judges", [])
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        problems.append(f"eval.judges: expected a list of reward sources, got {raw!r}")
        return []
    train_names = [r.name for r in built.get("rewards") or []]
    judges: list[RewardSource] = []
    for i, jv in _resolve_each(raw, "judges", checks, problems, resolved):
        got = checks.check("rewards", list[RewardSource], [jv], problems, f"eval.judges[{i}]")
        if not got:
            continue
        judge = got[0]
        if judge.name in train_names:
            problems.append(
                f"eval.judges[{i}]: {judge.name!r} is a training reward; a judge must be a scorer the policy is not "
                "trained on (list it in eval.rewards instead)"
            )
        elif judge.name in eval_reward_names:
            problems.append(f"eval.judges[{i}]: {judge.name!r} is also in eval.rewards; list it in one place")
        elif judge.name in [j.name for j in judges]:
            problems.append(f"eval.judges[{i}]: {judge.name!r} listed twice")
        judges.append(judge)
    return judges


def _resolve_each(
    raw: list[Any], key: str, checks: ComponentChecks, problems: list[str], resolved: dict[str, Any]
) -> Iterator[tuple[int, Any]]:
    """Resolve each entry of ``eval.<key>`` as a reward component (problems name ``eval.<key>[i]``), record it in
    ``resolved[key]``, and yield ``(i, resolved entry)`` for those that resolve."""
    resolved[key] = []
    for i, item in enumerate(raw):
        value = checks.resolve(item, f"eval.{key}[{i}]", "reward", problems)
        if value is not None:
            resolved[key].append(value)
            yield i, value


def score_set(
    spec: EvalSpec,
    set_name: str,
    media: Tensor,
    prompts: Sequence[str],
    metadata: list[dict[str, Any]],
    device: torch.device,
    frame_reduction: FrameReduction = "mean",
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Score one set's ``[N, F, H, W, 3]`` media with every evaluation reward and judge, one score per sample (an
    image scorer's per-frame scores reduced by ``frame_reduction``: :func:`rlpost.ops.media.score_media`).

    Returns:
        Per-sample scores by column (``<reward>``, ``judge/<judge>``) and their means by metric key.
    """
    scorers = [(r, r.name) for r in spec.rewards] + [(j, f"{JUDGE}/{j.name}") for j in spec.judges]
    scores: dict[str, list[float]] = {}
    on_device = media.to(device)
    for scorer, column in scorers:
        values = score_media(scorer, on_device, list(prompts), metadata, frame_reduction).cpu()
        scores[column] = [float(v) for v in values]
    metrics = {metric_key(set_name, r.name): _mean(scores[r.name]) for r in spec.rewards}
    for judge in spec.judges:
        metrics[metric_key(set_name, judge.name, judge=True)] = _mean(scores[f"{JUDGE}/{judge.name}"])
    return scores, metrics


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
