"""Scoring a rollout's samples with the recipe's reward sources, the step's ``reward`` phase.

Samples are media (``Rollout.media``, ``[S, F, H, W, 3]``): an image reward scores each sample's frames and their
scores are reduced to one per sample, a video reward scores whole clips (:mod:`rlpost.ops.media`); images are
one-frame media and take the same path.

Every source scores every sample; with several sources they run concurrently, one worker thread each (torch, PIL and
HTTP release the GIL), so a step waits for the slowest reward rather than the sum of all of them. A source that raises
or returns something other than one finite real number per sample does not stop the step on its own: it becomes a
guard event naming its plugin (:meth:`rlpost.engine.guards.Guards.plugin_failed`) and its scores are NaN, so the
step's bookkeeping stays shaped and ``guards.on_nonfinite`` decides (skip the update, or checkpoint and stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rlpost.core.api import RewardSource
from rlpost.core.contract import RewardScores, Rollout
from rlpost.core.plugin_errors import PluginRuntimeError
from rlpost.core.plugins import PluginHost
from rlpost.engine.guards import Guards
from rlpost.ops.media import FrameReduction, expected_scores, reduce_frames, reward_inputs

__all__ = ["reward_problem", "score_rollout", "set_up_rewards"]


def score_rollout(
    rewards: Sequence[RewardSource],
    weights: dict[str, float],
    rollout: Rollout,
    guards: Guards,
    host: PluginHost,
    reduction: FrameReduction = "mean",
) -> RewardScores:
    """Score ``rollout``'s samples with every source in ``rewards``.

    Args:
        rewards: The recipe's (set-up) reward sources.
        weights: ``reward_weights`` per source name.
        rollout: The rollout whose samples are scored.
        guards: The step's guards; failures and non-finite scores are recorded there.
        host: The plugin host, to name the plugin of a failing source.
        reduction: How an image reward's frame scores become a sample's (``reward_frames.reduction``).

    Returns:
        One ``[S]`` float tensor on the CPU per source (NaN where the source failed).
    """
    prompts, metadata = rollout.sample_prompts, rollout.sample_metadata

    def run(reward: RewardSource) -> Any:
        try:
            return reward.score(*reward_inputs(reward, rollout.media, prompts, metadata, reduction))
        except Exception as exc:  # noqa: BLE001 - a plugin's failure becomes a guard event naming it
            return exc

    if len(rewards) == 1:
        results = [run(rewards[0])]
    else:
        with ThreadPoolExecutor(max_workers=len(rewards), thread_name_prefix="rlpost-reward") as pool:
            results = list(pool.map(run, rewards))
    scores = {}
    n = rollout.num_samples
    for reward, raw in zip(rewards, results, strict=True):
        problem = reward_problem(raw, expected_scores(reward, rollout.media, reduction))
        if problem is not None:
            distribution, plugin = host.component_origin("reward", reward)
            error = PluginRuntimeError(distribution, plugin, f"reward {reward.name!r}", problem)
            error.__cause__ = raw if isinstance(raw, BaseException) else None  # its traceback, for --traceback
            guards.plugin_failed(error)
            scores[reward.name] = torch.full((n,), float("nan"))
            continue
        values = reduce_frames(raw.float().cpu(), reward, rollout.media, reduction)
        guards.finite_mask("reward", values, f"reward {reward.name!r}")
        scores[reward.name] = values
    return RewardScores(scores=scores, weights=weights)


def set_up_rewards(rewards: Sequence[RewardSource], device: torch.device, host: PluginHost) -> None:
    """Call each reward source's ``setup`` (load its model, reach its server).

    A source whose set-up raises is named with its plugin, like one that fails while scoring, instead of escaping as
    a traceback: a reward server that cannot be reached ends the run with one line naming the URL (the remote
    reward's error says it). ``OSError`` passes through unchanged: an unreadable checkpoint file is a bad input that
    the caller reports as such.

    Raises:
        PluginRuntimeError: A source's ``setup`` raised anything but ``OSError``.
    """
    for reward in rewards:
        try:
            reward.setup(device)
        except OSError:
            raise
        except Exception as exc:
            distribution, plugin = host.component_origin("reward", reward)
            problem = f"setup {reward_problem(exc, 0)}"
            raise PluginRuntimeError(distribution, plugin, f"reward {reward.name!r}", problem) from exc


def reward_problem(raw: Any, n: int) -> str | None:
    """Why a reward's return value (or the exception it raised) is not ``n`` scores, or ``None`` when it is."""
    if isinstance(raw, BaseException):
        text = str(raw).strip().splitlines()
        return f"raised {type(raw).__name__}" + (f": {text[0][:300]}" if text else "")
    if not isinstance(raw, torch.Tensor):
        return f"returned {type(raw).__name__}, expected a torch.Tensor of shape ({n},)"
    if raw.shape != (n,):
        return f"returned shape {tuple(raw.shape)}, expected ({n},)"
    if not (raw.is_floating_point() or raw.dtype in (torch.int32, torch.int64, torch.bool)):
        return f"returned dtype {raw.dtype}, expected real numbers"
    return None
