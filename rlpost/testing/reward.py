"""``check_reward_source``: a :class:`~rlpost.core.api.RewardSource` against its contract
(``rlpost/core/api/reward.py``, ``docs/rewards.md``).

The runner calls ``setup(device)`` once, then ``score`` on every step's decoded images (also from a worker thread,
next to the other rewards), so:

* ``media_scope`` is ``"frames"``, ``"image"`` or ``"video"`` (:mod:`rlpost.ops.media`);
* ``setup`` runs once without error (weights load there, never in the constructor);
* ``score`` of ``[S, H, W, 3]`` uint8 images (``[S, F, H, W, 3]`` clips for a ``"video"`` reward) returns a ``[S]``
  floating-point tensor of finite scores;
* scores do not depend on the batch: one call of ``S`` images equals ``S`` calls of one image (within ``tol``), so
  the number of samples per step or rank never changes a sample's reward;
* the same inputs give the same scores (one process, ``docs/design.md`` "Determinism");
* ``score`` changes none of its inputs (the grid, the hooks and the other rewards read the same images).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlpost.core.api import RewardSource
from rlpost.testing.inputs import PROMPTS, sample_images, sample_media
from rlpost.testing.violations import Checker, same_state, snapshot

__all__ = ["check_reward_source"]


def check_reward_source(
    reward: RewardSource,
    images: Tensor | None = None,
    prompts: list[str] | None = None,
    metadata: list[dict[str, Any]] | None = None,
    *,
    device: torch.device | str = "cpu",
    tol: float = 1e-5,
    setup: bool = True,
) -> Tensor | None:
    """Check ``reward`` against the reward contract (the module docstring lists the rules).

    Args:
        reward: The reward under check, freshly constructed (``setup`` is called here, once).
        images: ``[S, H, W, 3]`` uint8 images to score (``[S, F, H, W, 3]`` clips for a ``"video"`` reward); default
            :func:`rlpost.testing.sample_images` (4 of 32 px) or :func:`rlpost.testing.sample_media` (4 clips of 3
            frames).
        prompts: One prompt per image; default :data:`rlpost.testing.PROMPTS`, cycled.
        metadata: One metadata dict per image (what the prompt source gave its group); default empty dicts.
        device: Device handed to ``setup``.
        tol: Largest absolute and relative difference between batched and one-image scores.
        setup: Call ``setup`` (``False`` when the caller already did).

    Returns:
        The scores of the batch, or ``None`` when there were none.

    Raises:
        ConformanceError: Listing every broken rule.
    """
    check = Checker("reward source", reward)
    scope = getattr(reward, "media_scope", None)
    check.expect(
        scope in ("frames", "image", "video"), f"media_scope must be 'frames', 'image' or 'video', got {scope!r}"
    )
    if images is None:
        images = sample_media(frames=3) if scope == "video" else sample_images()
    n = int(images.shape[0])
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)] if prompts is None else list(prompts)
    metadata = [{} for _ in range(n)] if metadata is None else list(metadata)
    if setup and not check.ran("setup()", reward.setup, torch.device(device)):
        check.done()  # raises: nothing can be scored without set-up
    before = snapshot(images, prompts, metadata)
    scores = check.call("score()", reward.score, images, prompts, metadata)
    check.expect(same_state(snapshot(images, prompts, metadata), before), "score() changed its inputs in place")
    if scores is None:
        check.done()
        return None
    if not check.expect(
        isinstance(scores, Tensor) and scores.shape == (n,) and scores.is_floating_point(),
        f"score() must return a [{n}] floating-point tensor, got {_describe(scores)}",
    ):
        check.done()
        return None
    scores = scores.detach().cpu()
    check.expect(bool(torch.isfinite(scores).all()), f"score() returned non-finite scores: {scores.tolist()}")
    again = check.call("score()", reward.score, images, prompts, metadata)
    if isinstance(again, Tensor):
        check.expect(same_state(again.detach().cpu(), scores), "score() of the same inputs gave other scores")
    singles = [
        check.call("score()", reward.score, images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1])
        for i in range(n)
    ]
    if all(isinstance(x, Tensor) and x.shape == (1,) for x in singles):
        one_by_one = torch.cat([x.detach().cpu().to(scores.dtype) for x in singles])  # type: ignore[union-attr]
        gap = float((one_by_one - scores).abs().max())
        check.expect(
            bool(torch.allclose(one_by_one, scores, rtol=tol, atol=tol)),
            f"scores depend on the batch: one image at a time differs from the batch by {gap:.3g} (allowed {tol:g})",
        )
    else:
        check.expect(False, "score() of a single image must return a [1] tensor")
    check.done()
    return scores


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"{value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__
