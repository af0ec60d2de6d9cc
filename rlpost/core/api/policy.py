"""The policy (model adapter) contract: a flow-matching model seen as a denoising policy.

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from rlpost.core.api.component import Component

__all__ = ["Conditioning", "Policy", "resolve_guidance"]


@dataclass
class Conditioning:
    """Encoded prompts, one row per prompt (model specific tensors, e.g. SD3's ``prompt_embeds`` and
    ``pooled_prompt_embeds``, each with the negative-prompt rows when classifier-free guidance is on).

    Negative-prompt tensors are named ``negative_*`` (``negative_prompt_embeds``, ...): a velocity at guidance 1 (the
    conditional branch alone) never reads them, and ``rlpost.testing.check_policy`` checks it by dropping them.

    Attributes:
        tensors: Name -> tensor whose first dimension indexes prompts.
    """

    tensors: dict[str, Tensor]

    def select(self, rows: Tensor) -> Conditioning:
        """Return the conditioning of ``rows`` (a ``[B]`` long tensor of prompt indices)."""
        return Conditioning({k: v.index_select(0, rows.to(v.device)) for k, v in self.tensors.items()})


def resolve_guidance(
    guidance: float | None, configured: float, *, can_guide: bool, setting: str = "model.init_args.guidance_scale"
) -> float:
    """The guidance scale one :meth:`Policy.velocity` call runs at, with the contract's errors.

    Args:
        guidance: The call's ``guidance`` argument (``None``: the configured scale).
        configured: The adapter's configured scale (what rollouts use).
        can_guide: Whether a scale above 1 can be applied now: a CFG adapter whose ``encode`` computed the
            negative-prompt rows (configured above 1); a guidance-distilled model, whose scale is an input, always.
        setting: The recipe field that turns guidance on, named in the error.

    Returns:
        ``configured`` when ``guidance`` is ``None`` (unchecked: the constructor declared its range), else
        ``guidance``.

    Raises:
        ValueError: ``guidance`` below 1 or not finite, or above 1 without ``can_guide``.
    """
    if guidance is None:
        return configured
    g = float(guidance)
    if not math.isfinite(g) or g < 1.0:
        raise ValueError(f"guidance must be a finite number >= 1 (1 = the conditional branch alone), got {guidance}")
    if g > 1.0 and not can_guide:
        raise ValueError(
            f"guidance {g:g} needs negative-prompt embeddings; set {setting} > 1 so encode() computes them"
        )
    return g


class Policy(Component):
    """A flow-matching text-to-image model seen as a denoising policy (rectified flow: ``x_σ = (1-σ)x0 + σε``).

    The model adapter hides everything model specific (prompt encoding, the transformer call signature, latent
    packing, VAE decoding) so samplers and update rules are written once for SD3, FLUX or a test model.

    Guidance. The rollout guidance is the adapter's configured ``guidance_scale`` (Qwen-Image: ``true_cfg_scale``):
    samplers call :meth:`velocity` without ``guidance`` and get it. A training or reference guidance is chosen per
    call by the update rule (``velocity(..., guidance=g)``): likelihood-free methods sample at one scale and train at
    another (DGPO rolls out at CFG 4.5, trains the conditional branch alone, ``guidance=1.0``, and evaluates its
    frozen reference at 4.5). Classifier-free guidance above 1 needs the negative-prompt rows, which ``encode``
    computes only when the configured scale is above 1; a guidance-distilled model (FLUX.1-dev) feeds ``g`` to its
    guidance embedding instead. :func:`resolve_guidance` checks a per-call value.
    """

    kind: ClassVar[str] = "model"
    media: ClassVar[str] = "image"
    """What the model generates: ``"image"`` or ``"video"`` (reports, model cards' ``pipeline_tag``)."""

    forward_count: int = 0
    """Denoiser evaluations so far, in batch rows before CFG doubling, summed over :meth:`velocity` calls.

    Adapters add each call's ``B`` in :meth:`velocity`; readers (tests, ``rlpost bench``) take differences around a
    rollout or an update and compare them with :meth:`Sampler.counts`. Never reset by the core."""

    @abstractmethod
    def setup(self, device: torch.device) -> None:
        """Load weights and move to ``device``. Called once by the runner, after validation."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device of the denoiser."""

    @abstractmethod
    def sigmas(self, num_steps: int) -> Tensor:
        """``[num_steps + 1]`` fp32 noise levels from 1 (noise) to 0 (data), time-shifted as the model expects.

        This is the run's one time grid: every sampler and the held-out evaluation step through it. Adapters build
        it with :func:`rlpost.ops.schedules.time_grid_sigmas` from a recipe-level grid name (SD3:
        ``model.init_args.time_grid``, ``"diffusers"`` or ``"shifted-linspace"``), so one recipe value sets it for
        all of them.
        """

    @abstractmethod
    def initial_noise(self, num: int, generator: torch.Generator) -> Tensor:
        """``[num, *latent_shape]`` fp32 standard normal latents drawn from ``generator``."""

    @abstractmethod
    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts (cached per prompt string); one row per prompt."""

    @abstractmethod
    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None = None) -> Tensor:
        """Predict the velocity ``v ≈ ε - x0`` (guidance applied) in fp32.

        Args:
            latents: ``[B, *latent_shape]`` states.
            sigma: ``[B]`` noise level of each state.
            cond: Conditioning with ``B`` rows (already selected per state).
            guidance: ``None``: the configured guidance (rollouts; bit for bit the call without it). ``1.0``: the
                conditional branch alone, one denoiser pass over the ``B`` rows (negative rows, if any, unread).
                ``g > 1``: guidance at scale ``g`` (classifier-free guidance needs the negative rows).

        Raises:
            ValueError: ``guidance`` below 1 or not finite, or above 1 on an adapter whose conditioning has no
                negative-prompt rows (configured without CFG); the message names the setting to change.
        """

    @abstractmethod
    def decode(self, latents: Tensor) -> Tensor:
        """Decode clean latents to ``[B, F, H, W, 3]`` uint8 media: :attr:`frames` frames per sample (``F = 1`` for an
        image model), the layout of ``Rollout.media``."""

    @property
    def frames(self) -> int:
        """Frames ``F`` that :meth:`decode` gives per sample: 1 for an image model (the default). Known from the
        settings alone, before :meth:`setup`, so ``rlpost validate`` can check rewards against it."""
        return 1

    @abstractmethod
    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters the optimizer updates (LoRA adapters or the whole denoiser)."""

    def clean_tail_steps(self) -> int | None:
        """How many final steps of this model's time grid land on a (near-)clean level, for any ``T >= 2``.

        Samplers that must not leave sampled noise in the decoded image keep those steps deterministic and check
        their settings against it in ``validate`` (before :meth:`setup`, so adapters answer from their settings
        alone). SD3's ``"diffusers"`` grid ends ``... -> σ_min -> 0`` (2); a grid whose last nonzero level is
        ``shift(1/T)`` (SD3's ``"shifted-linspace"``, both FLUX grids) has 1. ``None`` (the default): unknown, and
        samplers skip the check. See ``docs/models.md``, "Time grids".
        """
        return None

    def reference(self) -> AbstractContextManager[None]:
        """Context in which :meth:`velocity` uses the frozen reference model (for KL terms).

        Raises:
            NotImplementedError: When the policy was not set up with a reference.
        """
        raise NotImplementedError(f"{type(self).__name__} has no frozen reference model")

    def train(self, mode: bool = True) -> None:  # noqa: B027 - optional hook with a no-op default
        """Put the trainable module in train (``True``) or eval mode."""
