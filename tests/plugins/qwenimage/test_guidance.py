"""``QwenImagePolicy.velocity``'s per-call ``guidance`` on the tiny Qwen-Image: ``None`` is ``true_cfg_scale`` bit for
bit; ``1.0`` is the prompt rows alone in one pass (no rescaling), equal to QwenImagePipeline's conditional forward
computed by hand; ``w > 1`` is true CFG at ``w`` with the pipeline's norm rescaling; an adapter configured without
guidance refuses ``w > 1`` naming ``true_cfg_scale`` (the SD3/FLUX/Wan ones: tests/unit/models/test_guidance.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlpost import pack_latents, unpack_latents
from rlpost_qwenimage.policy import QwenImagePolicy
from tests.tolerances import assert_fp32_close

PROMPTS = ["a photo of a cat", "two birds in a tree next to a green house"]  # different token counts: padding
SIGMA = torch.tensor([0.7, 0.4])


def _by_hand(policy: QwenImagePolicy, x: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor) -> Any:
    """One QwenImagePipeline transformer forward (its separate conditional or negative call) on packed tokens."""
    _, _, h, w = x.shape
    return policy.transformer(
        hidden_states=pack_latents(x),
        timestep=SIGMA,
        encoder_hidden_states=embeds,
        encoder_hidden_states_mask=None if bool(mask.all()) else mask,
        img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0],
        return_dict=False,
    )[0]


@torch.no_grad()
def test_guidance_per_call(make_qwen_policy: Callable[..., QwenImagePolicy]) -> None:
    policy = make_qwen_policy(true_cfg_scale=4.0)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    cond = policy.encode(PROMPTS)
    v = policy.velocity(x, SIGMA, cond)
    assert torch.equal(policy.velocity(x, SIGMA, cond, guidance=None), v)  # the same computation, one process
    t, (h, w) = cond.tensors, x.shape[2:]
    text = _by_hand(policy, x, t["prompt_embeds"], t["prompt_embeds_mask"])
    uncond = _by_hand(policy, x, t["negative_prompt_embeds"], t["negative_prompt_embeds_mask"])

    rows: list[int] = []
    handle = policy.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(int(kwargs["hidden_states"].shape[0])), with_kwargs=True
    )
    try:
        start = policy.forward_count
        alone = policy.velocity(x, SIGMA, cond, guidance=1.0)
    finally:
        handle.remove()
    assert rows == [2] and policy.forward_count - start == 2  # one pass over the prompt rows, no negative rows
    assert_fp32_close(alone, unpack_latents(text, h, w))

    for scale in (4.0, 2.5):
        combined = uncond + scale * (text - uncond)
        rescaled = combined * (text.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        assert_fp32_close(policy.velocity(x, SIGMA, cond, guidance=scale), unpack_latents(rescaled, h, w))
    for bad in (0.5, float("nan")):
        with pytest.raises(ValueError, match=r"guidance must be a finite number >= 1"):
            policy.velocity(x, SIGMA, cond, guidance=bad)


@torch.no_grad()
def test_without_guidance_a_scale_above_one_names_true_cfg_scale(
    make_qwen_policy: Callable[..., QwenImagePolicy],
) -> None:
    policy = make_qwen_policy(true_cfg_scale=1.0)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    cond = policy.encode(PROMPTS)
    message = r"guidance 4 needs negative-prompt embeddings; set model.init_args.true_cfg_scale > 1 so encode\(\)"
    with pytest.raises(ValueError, match=message):
        policy.velocity(x, SIGMA, cond, guidance=4.0)
    assert_fp32_close(policy.velocity(x, SIGMA, cond, guidance=1.0), policy.velocity(x, SIGMA, cond))
