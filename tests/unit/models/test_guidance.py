"""``Policy.velocity``'s per-call ``guidance`` on the built-in adapters (SD3, Wan2.1: classifier-free guidance; FLUX.1:
the distilled guidance embedding), on the tiny real-architecture models.

``None`` is the configured guidance bit for bit (the same computation in one process); ``1.0`` is the conditional
branch alone, one transformer pass over the ``B`` rows, equal to the conditional half of the pipeline's CFG batch
computed by hand; ``g > 1`` is CFG at ``g`` and needs the negative rows, so an adapter configured without CFG refuses
it naming the setting. Qwen-Image's are in ``tests/plugins/qwenimage/test_guidance.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.core.api import Conditioning, Policy
from rlpost.models.flux import FluxPolicy, pack_latents, unpack_latents
from rlpost.models.sd3 import SD3Policy
from rlpost.models.tiny import build_tiny_flux
from rlpost.models.wan import WanPolicy
from rlpost.ops.schedules import timesteps_from_sigmas
from tests.models_fixtures_wan import *  # noqa: F403  (the fixtures tiny_wan_dir, make_wan_policy)
from tests.tolerances import assert_fp32_close

PROMPTS = ["a photo of a cat", "a red dog"]
SIGMA = torch.tensor([0.7, 0.4])


def _inputs(policy: Policy) -> tuple[torch.Tensor, Conditioning]:
    return policy.initial_noise(2, torch.Generator().manual_seed(0)), policy.encode(PROMPTS)


@contextmanager
def _rows_seen(transformer: torch.nn.Module) -> Iterator[list[int]]:
    """The batch rows of every transformer forward inside the block."""
    seen: list[int] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(int(kwargs["hidden_states"].shape[0]))

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _assert_none_is_the_configured_guidance(policy: Policy, x: torch.Tensor, cond: Conditioning) -> None:
    v = policy.velocity(x, SIGMA, cond)
    assert torch.equal(policy.velocity(x, SIGMA, cond, guidance=None), v)  # the same computation, one process


def _assert_conditional_alone(policy: Any, x: torch.Tensor, cond: Conditioning, text: torch.Tensor) -> None:
    """``guidance=1.0``: one pass over the two rows (counted as two), equal to the CFG batch's conditional half."""
    start = policy.forward_count
    with _rows_seen(policy.transformer) as seen:
        alone = policy.velocity(x, SIGMA, cond, guidance=1.0)
    assert seen == [2] and policy.forward_count - start == 2
    assert_fp32_close(alone, text)


def _assert_bad_guidance_refused(policy: Policy, x: torch.Tensor, cond: Conditioning) -> None:
    for bad in (0.5, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"guidance must be a finite number >= 1"):
            policy.velocity(x, SIGMA, cond, guidance=bad)


@torch.no_grad()
def test_sd3_guidance_per_call(make_sd3_policy: Callable[..., SD3Policy]) -> None:
    policy = make_sd3_policy(guidance_scale=4.5)
    x, cond = _inputs(policy)
    _assert_none_is_the_configured_guidance(policy, x, cond)
    t, ts = cond.tensors, timesteps_from_sigmas(SIGMA)
    out = policy.transformer(  # StableDiffusion3Pipeline's CFG batch [uncond; cond], by hand
        hidden_states=torch.cat([x, x]),
        timestep=torch.cat([ts, ts]),
        encoder_hidden_states=torch.cat([t["negative_prompt_embeds"], t["prompt_embeds"]]),
        pooled_projections=torch.cat([t["negative_pooled_prompt_embeds"], t["pooled_prompt_embeds"]]),
        return_dict=False,
    )[0]
    uncond, text = out.chunk(2)
    _assert_conditional_alone(policy, x, cond, text)
    with _rows_seen(policy.transformer) as seen:
        assert_fp32_close(policy.velocity(x, SIGMA, cond, guidance=2.0), uncond + 2.0 * (text - uncond))
    assert seen == [4]  # CFG at another scale: one doubled batch
    assert_fp32_close(policy.velocity(x, SIGMA, cond), uncond + 4.5 * (text - uncond))
    _assert_bad_guidance_refused(policy, x, cond)


@torch.no_grad()
def test_sd3_without_cfg_refuses_guidance_above_one(make_sd3_policy: Callable[..., SD3Policy]) -> None:
    policy = make_sd3_policy(guidance_scale=1.0)
    x, cond = _inputs(policy)
    assert not any(name.startswith("negative_") for name in cond.tensors)
    message = r"guidance 4.5 needs negative-prompt embeddings; set model.init_args.guidance_scale > 1 so encode\(\)"
    with pytest.raises(ValueError, match=message):
        policy.velocity(x, SIGMA, cond, guidance=4.5)
    assert_fp32_close(policy.velocity(x, SIGMA, cond, guidance=1.0), policy.velocity(x, SIGMA, cond))


@torch.no_grad()
def test_wan_guidance_per_call(make_wan_policy: Callable[..., WanPolicy]) -> None:
    policy = make_wan_policy(guidance_scale=5.0)
    x, cond = _inputs(policy)
    _assert_none_is_the_configured_guidance(policy, x, cond)
    t, ts = cond.tensors, timesteps_from_sigmas(SIGMA)
    out = policy.transformer(  # the adapter's (DanceGRPO's) CFG batch [cond; uncond], by hand
        hidden_states=torch.cat([x, x]),
        timestep=torch.cat([ts, ts]),
        encoder_hidden_states=torch.cat([t["prompt_embeds"], t["negative_prompt_embeds"]]),
        return_dict=False,
    )[0]
    text, uncond = out.chunk(2)
    _assert_conditional_alone(policy, x, cond, text)
    assert_fp32_close(policy.velocity(x, SIGMA, cond, guidance=3.0), uncond + 3.0 * (text - uncond))
    _assert_bad_guidance_refused(policy, x, cond)
    plain = make_wan_policy(guidance_scale=1.0)
    with pytest.raises(ValueError, match=r"guidance 2 needs negative-prompt embeddings; set model.init_args.guidance"):
        plain.velocity(x, SIGMA, plain.encode(PROMPTS), guidance=2.0)


def _flux_by_hand(policy: FluxPolicy, x: torch.Tensor, cond: Conditioning, embedded: torch.Tensor | None) -> Any:
    """One FluxPipeline transformer call (timestep σ, ids, packing) with ``embedded`` as the guidance input."""
    t = cond.tensors
    txt_ids = torch.zeros(t["prompt_embeds"].shape[1], 3)
    out = policy.transformer(
        hidden_states=pack_latents(x),
        timestep=SIGMA,
        guidance=embedded,
        pooled_projections=t["pooled_prompt_embeds"],
        encoder_hidden_states=t["prompt_embeds"],
        txt_ids=txt_ids,
        img_ids=policy._img_ids,
        return_dict=False,
    )[0]
    return unpack_latents(out, x.shape[2], x.shape[3])


@torch.no_grad()
def test_flux_guidance_sets_the_distilled_embedding(make_flux_policy: Callable[..., FluxPolicy]) -> None:
    """FLUX.1-dev has no CFG pass: every guidance is one forward, its value fed to the guidance embedding."""
    policy = make_flux_policy(guidance_scale=3.5)
    x, cond = _inputs(policy)
    _assert_none_is_the_configured_guidance(policy, x, cond)
    assert_fp32_close(policy.velocity(x, SIGMA, cond), _flux_by_hand(policy, x, cond, torch.full((2,), 3.5)))
    _assert_conditional_alone(policy, x, cond, _flux_by_hand(policy, x, cond, torch.full((2,), 1.0)))
    with _rows_seen(policy.transformer) as seen:
        v7 = policy.velocity(x, SIGMA, cond, guidance=7.0)
    assert seen == [2]  # no negative prompt, no doubled batch
    assert_fp32_close(v7, _flux_by_hand(policy, x, cond, torch.full((2,), 7.0)))
    assert (v7 - policy.velocity(x, SIGMA, cond)).abs().max() > 1e-4  # it reached the embedding
    _assert_bad_guidance_refused(policy, x, cond)


@torch.no_grad()
def test_flux_without_a_guidance_embedding_ignores_guidance(tmp_path: Path) -> None:
    """FLUX.1-schnell (no guidance embedding) has one velocity: the per-call value is checked, then ignored as the
    configured one is."""
    directory = build_tiny_flux(tmp_path / "schnell", seed=0, guidance_embeds=False)
    policy = FluxPolicy(str(directory), resolution=32, dtype="float32", max_sequence_length=32)
    policy.setup(torch.device("cpu"))
    x, cond = _inputs(policy)
    expected = _flux_by_hand(policy, x, cond, None)
    for guidance in (None, 1.0, 4.5):
        assert_fp32_close(policy.velocity(x, SIGMA, cond, guidance=guidance), expected)
    _assert_bad_guidance_refused(policy, x, cond)
