"""No sampler scores an image that holds more residual sampled noise than its upstream configuration does.

Measured on the digits model (``assets/digits-sd3``: a trained SD3-architecture model whose identity VAE makes the
latent the 16x16 image, ``docs/digits.md``), 10 steps, CFG 1 (the bench's settings), on both time grids, with the
10 prompts of one RL template and 4 images each.

Residual sampled noise of a sampler configuration = the mean *excess pixel roughness* of the images it decodes:
roughness (mean absolute difference of horizontally and vertically adjacent pixels, grey levels 0-255) of each
image minus that of the deterministic Euler-ODE image from the same initial noise on the same grid. Sampled noise the
remaining steps cannot remove shows up as pixel-level roughness; variation the model turns into image content does
not. On this model the ODE images have roughness ~22.6; a sampled step into diffusers' ``σ_min`` adds 3-4 grey
levels (an earlier measurement: DanceGRPO 27.4, DDPO 24.6 at the same ODE level), while a configuration whose sampled
noise later steps remove stays within about one grey level of its ODE images, mostly below them (docs/models.md
"Time grids" lists the measured values).

Upstream configurations (restated, not imported from the samplers under test):

* DanceGRPO (``XueZeyue/DanceGRPO`` ``fastvideo/train_grpo_flux.py``@15cc71d ``run_sample_step``): the
  shifted-linspace grid, DanceGRPO's SDE at every step, the last step's ``x̂0 = x - σ_{T-1}·v`` decoded.
* DDPO (``kvablack/ddpo-pytorch`` ``ddpo_pytorch/diffusers_patch/ddim_with_logprob.py``@1958463): DDIM with
  ``η = 1`` at every step, the final state decoded. Its grid is SD1.5's DDIM timesteps, which have no flow analogue,
  so the reference is DDIM (η = 1) restated in rectified-flow coordinates on the *same* grid: the DDPM posterior
  ``std = σ'·sqrt(1 - ((1-σ)·σ' / ((1-σ')·σ))²)`` (Song et al. 2021, arXiv 2010.02502, eq. 16).
* MixGRPO (``Tencent-Hunyuan/MixGRPO`` ``fastvideo/train_grpo_flux.py``@e5cdd6a): the shifted-linspace grid with
  windows before ``T - 2``; the reference is rlpost's MixGRPO sampler (same window, same Flash tail) on that grid.
* TreeGRPO (official code samples through the diffusers SD3 pipeline): the reference is rlpost's tree sampler on
  the diffusers grid, window at the latest start the paper's law allows (the worst case). On the diffusers grid the
  configuration *is* upstream's, so only the shifted-linspace grid is compared.

Tolerance: ``TOLERANCE`` grey levels of excess roughness, a third of the smallest violation measured
(DDPO, +2.7). With fixed seeds the statistic is deterministic up to float rounding; over the three RL templates an
accepted configuration exceeded its reference by at most 0.25.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from rlpost.core.api import Sampler
from rlpost.core.contract import PromptBatch
from rlpost.models.sd3 import SD3Policy
from rlpost.ops.kernels import DanceGRPOSDE, EulerODE
from rlpost.ops.schedules import TimeGrid
from rlpost_dancegrpo.sampler import DanceGRPOSampler
from rlpost_ddpo.sampler import DDPOSampler
from rlpost_digits import DIGITS_SD3_DIR
from rlpost_digits.pretrain import MAX_SEQUENCE_LENGTH
from rlpost_digits.prompts import DigitsPrompts
from rlpost_mixgrpo.sampler import MixGRPOSampler
from rlpost_treegrpo.sampler import TreeSampler

pytestmark = pytest.mark.slow  # ~25k transformer rows of the digits model

T = 10
PER_PROMPT = 4
TOLERANCE = 0.9
GRIDS: tuple[TimeGrid, ...] = ("diffusers", "shifted-linspace")

StepFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [p for p, _ in DigitsPrompts(split="rl").load()][:10]  # the first RL template x 10 digits


@pytest.fixture(scope="module")
def policies() -> dict[str, SD3Policy]:
    out: dict[str, SD3Policy] = {}
    for grid in GRIDS:
        policy = SD3Policy(
            pretrained=str(DIGITS_SD3_DIR),
            resolution=16,
            guidance_scale=1.0,
            dtype="float32",
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            time_grid=grid,
        )
        policy.setup(torch.device("cpu"))
        out[grid] = policy
    return out


def roughness(images: Tensor) -> Tensor:
    """``[S]`` mean absolute difference of adjacent pixels (horizontal and vertical), in grey levels 0-255."""
    x = images.float().mean(-1)
    return ((x[:, :, 1:] - x[:, :, :-1]).abs().mean((1, 2)) + (x[:, 1:, :] - x[:, :-1, :]).abs().mean((1, 2))) / 2


_ODE_CACHE: dict[tuple[str, bytes, tuple[str, ...]], Tensor] = {}


@torch.no_grad()
def ode_images(policy: SD3Policy, noise: Tensor, prompts: list[str]) -> Tensor:
    """Euler-ODE images from ``noise`` along the policy's grid (the evaluation sampler); cached, since samplers
    drawing from the same seed start from the same noises."""
    key = (policy.time_grid, noise.numpy().tobytes(), tuple(prompts))
    if key not in _ODE_CACHE:
        _ODE_CACHE[key] = _ode_images(policy, noise, prompts)
    return _ODE_CACHE[key]


def _ode_images(policy: SD3Policy, noise: Tensor, prompts: list[str]) -> Tensor:
    cond, sig, x, n = policy.encode(prompts), policy.sigmas(T), noise, noise.shape[0]
    for i in range(T):
        s, sn = sig[i].expand(n), sig[i + 1].expand(n)
        x = EulerODE().step(x, policy.velocity(x, s, cond), s, sn, None).next_latents
    return policy.decode(x).flatten(0, 1)  # one-frame media -> images


def excess(policy: SD3Policy, images: Tensor, noise: Tensor, prompts: list[str]) -> float:
    """Mean roughness of ``images`` minus that of the ODE images from the same initial noises (one per root)."""
    return float(roughness(images).mean() - roughness(ode_images(policy, noise, prompts)).mean())


@torch.no_grad()
def sampler_excess(sampler: Sampler, policy: SD3Policy, prompts: list[str], seed: int = 0) -> float:
    batch = PromptBatch(prompts, [{} for _ in prompts], PER_PROMPT)
    sampler.begin_step(0, torch.Generator().manual_seed(seed))
    rollout = sampler.rollout(policy, batch, torch.Generator().manual_seed(seed))
    roots = (rollout.node_step == 0).nonzero().flatten()
    root_prompts = [prompts[int(g)] for g in rollout.node_group[roots]]
    # Every root leads to the same number of images (1 per chain, k^d per tree), so a plain mean over roots matches.
    return excess(policy, rollout.frames(), rollout.states[roots], root_prompts)


@torch.no_grad()
def reference_excess(policy: SD3Policy, prompts: list[str], step: StepFn, decode_last_x0: bool, seed: int = 0) -> float:
    """Chains with ``step(x, v, σ, σ', z)`` at every step; decode the final state or the last step's ``x̂0``."""
    gen = torch.Generator().manual_seed(seed)
    rows = [p for p in prompts for _ in range(PER_PROMPT)]
    noise = policy.initial_noise(len(rows), gen)
    cond, sig, x, n = policy.encode(rows), policy.sigmas(T), noise, noise.shape[0]
    for i in range(T):
        s, sn = sig[i].expand(n), sig[i + 1].expand(n)
        v = policy.velocity(x, s, cond)
        if decode_last_x0 and i == T - 1:
            x = x - sig[i] * v  # upstream samples this step too, but decodes x̂0: the sampled state is discarded
            break
        x = step(x, v, s, sn, torch.randn(x.shape, generator=gen))
    return excess(policy, policy.decode(x).flatten(0, 1), noise, rows)


def dance_step(x: Tensor, v: Tensor, s: Tensor, sn: Tensor, z: Tensor) -> Tensor:
    return DanceGRPOSDE(eta=0.3).step(x, v, s, sn, None, noise=z).next_latents


def ddim_step(x: Tensor, v: Tensor, s: Tensor, sn: Tensor, z: Tensor) -> Tensor:
    """DDIM, η = 1, in rectified-flow coordinates (``x = (1-σ)·x0 + σ·ε``)."""
    s, sn = s.view(-1, 1, 1, 1), sn.view(-1, 1, 1, 1)
    x0, eps = x - s * v, x + (1 - s) * v
    ratio = (1 - s) * sn / ((1 - sn) * s)
    std = sn * torch.sqrt(torch.clamp(1 - ratio**2, min=0))
    return (1 - sn) * x0 + torch.sqrt(torch.clamp(sn**2 - std**2, min=0)) * eps + std * z


_REFERENCES: dict[tuple[str, str], float] = {}


def reference(name: str, grid: str, policies: dict[str, SD3Policy], prompts: list[str]) -> float:
    """Excess roughness of an upstream configuration (cached per name and grid)."""
    if (name, grid) not in _REFERENCES:
        if name == "dance":  # DanceGRPO's own grid, whatever the grid under test
            value = reference_excess(policies["shifted-linspace"], prompts, dance_step, decode_last_x0=True)
        else:
            value = reference_excess(policies[grid], prompts, ddim_step, decode_last_x0=False)
        _REFERENCES[(name, grid)] = value
    return _REFERENCES[(name, grid)]


# Shipped chain-sampler configurations (their defaults, the recipes' settings and every final/penultimate option
# validation accepts on the grid), with the upstream configuration each is held to.
CHAIN_CASES: list[tuple[str, str, Callable[[], Sampler], str]] = [
    ("dance final ode", "diffusers", lambda: DanceGRPOSampler(num_steps=T), "dance"),
    ("dance final ode", "shifted-linspace", lambda: DanceGRPOSampler(num_steps=T), "dance"),
    ("dance final sde", "diffusers", lambda: DanceGRPOSampler(num_steps=T, final_step="sde"), "dance"),
    ("dance final sde", "shifted-linspace", lambda: DanceGRPOSampler(num_steps=T, final_step="sde"), "dance"),
    (
        "dance upstream-exact (recipe)",
        "shifted-linspace",
        lambda: DanceGRPOSampler(num_steps=T, penultimate_step="sde"),
        "dance",
    ),
    (
        "dance upstream-exact, final sde",
        "shifted-linspace",
        lambda: DanceGRPOSampler(num_steps=T, penultimate_step="sde", final_step="sde"),
        "dance",
    ),
    ("ddpo", "diffusers", lambda: DDPOSampler(num_steps=T), "ddim"),
    ("ddpo", "shifted-linspace", lambda: DDPOSampler(num_steps=T), "ddim"),
    ("ddpo final sde", "diffusers", lambda: DDPOSampler(num_steps=T, final_step="sde"), "ddim"),
    ("ddpo penultimate sde", "shifted-linspace", lambda: DDPOSampler(num_steps=T, penultimate_step="sde"), "ddim"),
]


@pytest.mark.parametrize(
    ("label", "grid", "make", "upstream"), CHAIN_CASES, ids=[f"{c[0]}|{c[1]}" for c in CHAIN_CASES]
)
def test_chain_samplers_leave_no_more_noise_than_upstream(
    label: str,
    grid: str,
    make: Callable[[], Sampler],
    upstream: str,
    policies: dict[str, SD3Policy],
    prompts: list[str],
) -> None:
    ours = sampler_excess(make(), policies[grid], prompts)
    ref = reference(upstream, grid, policies, prompts)
    print(f"excess roughness: {label} on {grid}: {ours:+.2f}; upstream ({upstream}): {ref:+.2f}")  # shown by -rA
    assert ours <= ref + TOLERANCE, (
        f"{label} on the {grid} grid: excess roughness {ours:.2f} vs upstream {ref:.2f} (+{TOLERANCE} allowed)"
    )


def mix(dpm: bool) -> MixGRPOSampler:
    # One window over every step the scheduler allows, [0, T-2): its last SDE step is the latest one any shipped
    # MixGRPO configuration samples (the worst case for residual noise).
    return MixGRPOSampler(num_steps=T, window_size=T - 2, window_stride=0, dpm_after_window=dpm, shift=1.0)


def tree() -> TreeSampler:
    return TreeSampler(num_steps=T, k=3, depth=3, window="fixed", fixed_start=T - 3 - 1, chunk_size=256)


UPSTREAM_GRID_CASES: list[tuple[str, str, Callable[[], Any]]] = [
    ("mixgrpo", "diffusers", lambda: mix(False)),  # upstream grid: shifted-linspace
    ("mixgrpo-flash", "diffusers", lambda: mix(True)),
    ("treegrpo", "shifted-linspace", tree),  # upstream grid: diffusers
]


@pytest.mark.parametrize(("label", "grid", "make"), UPSTREAM_GRID_CASES, ids=[c[0] for c in UPSTREAM_GRID_CASES])
def test_window_samplers_leave_no_more_noise_than_on_their_upstream_grid(
    label: str,
    grid: str,
    make: Callable[[], Sampler],
    policies: dict[str, SD3Policy],
    prompts: list[str],
) -> None:
    upstream_grid = next(g for g in GRIDS if g != grid)
    ours = sampler_excess(make(), policies[grid], prompts)
    ref = sampler_excess(make(), policies[upstream_grid], prompts)
    print(f"excess roughness: {label} on {grid}: {ours:+.2f}; on {upstream_grid}: {ref:+.2f}")  # shown by -rA
    assert ours <= ref + TOLERANCE, (
        f"{label} on the {grid} grid: excess roughness {ours:.2f} vs {ref:.2f} on its upstream {upstream_grid} grid"
    )


def test_the_statistic_detects_noise_left_by_a_step_into_sigma_min(
    policies: dict[str, SD3Policy], prompts: list[str]
) -> None:
    """The measurement itself: sampling the step into diffusers' σ_min leaves +3 grey levels."""
    policy = policies["diffusers"]
    noisy = reference_excess(
        policy,
        prompts,
        lambda x, v, s, sn, z: dance_step(x, v, s, sn, z) if float(sn[0]) > 0 else x + (sn - s).view(-1, 1, 1, 1) * v,
        decode_last_x0=False,
    )
    print(f"excess roughness: DanceGRPO SDE into sigma_min on diffusers: {noisy:+.2f}")  # shown by -rA
    assert noisy > reference("dance", "diffusers", policies, prompts) + 3 * TOLERANCE
