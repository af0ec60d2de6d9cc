"""FLUX.1 (dev / schnell) as an rlpost :class:`~rlpost.core.api.Policy`, on the real diffusers stack.

Everything FLUX specific lives here: loading ``FluxPipeline``, prompt encoding (CLIP pooled + T5 sequence), the
``FluxTransformer2DModel`` call (2x2-packed latent tokens with ``img_ids`` / ``txt_ids``, timestep as ``σ``, the
distilled guidance scale as a transformer input), the resolution-dependent time shift and the VAE scaling/shift.

The seam is unchanged from SD3: samplers and kernels see image-shaped latents ``[B, C, H/f, W/f]``. Packing into
``[B, (H/2f)(W/2f), 4C]`` tokens happens inside :meth:`FluxPolicy.velocity` and is undone before it returns, so every
step kernel, log-prob reduction (a mean or sum over all latent elements is the same in either layout) and sampler
works on FLUX without knowing it.

With the Euler ODE kernel and the default ``time_grid="diffusers"``, sampling through this adapter reproduces
``FluxPipeline.__call__`` (same sigmas, ``mu`` from the image sequence length, timestep ``σ``, guidance input,
packing); the test suite checks this on a tiny model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from rlpost.core.api import Conditioning, Policy, Range
from rlpost.core.hookspecs import hookimpl
from rlpost.core.registry import Registry
from rlpost.models._common import DiffusersTransformerPolicy
from rlpost.models.adapter_settings import DTypeName, LoraSpec
from rlpost.models.pipeline_dir import ModelDirError, vae_block_factor
from rlpost.models.tiny import TINY_VAE_FACTOR, ensure_tiny_flux, parse_tiny_id
from rlpost.ops.schedules import TimeGrid, shifted_linspace_sigmas, timesteps_from_sigmas

__all__ = ["FluxPolicy", "flux_mu", "flux_sigmas", "pack_latents", "rlpost_register_models", "unpack_latents"]


def pack_latents(latents: Tensor) -> Tensor:
    """``[B, C, h, w]`` -> ``[B, (h/2)(w/2), 4C]`` 2x2 patch tokens, in ``FluxPipeline._pack_latents``' order."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: Tensor, h: int, w: int) -> Tensor:
    """Inverse of :func:`pack_latents` (``FluxPipeline._unpack_latents``): tokens back to ``[B, C, h, w]``."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def flux_mu(image_seq_len: int, scheduler_config: Any) -> float:
    """The dynamic-shift parameter ``mu``: linear in the number of image tokens, as ``FluxPipeline`` computes it
    (diffusers ``pipelines/flux/pipeline_flux.py`` ``calculate_shift``), from the scheduler config's
    ``base_image_seq_len`` / ``max_image_seq_len`` / ``base_shift`` / ``max_shift`` (FLUX.1: 256 / 4096 / 0.5 / 1.15).
    """
    get = scheduler_config.get
    base_len, max_len = int(get("base_image_seq_len", 256)), int(get("max_image_seq_len", 4096))
    base_shift, max_shift = float(get("base_shift", 0.5)), float(get("max_shift", 1.15))
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


def flux_sigmas(num_steps: int, mu: float, scheduler_config: Any) -> Tensor:
    """``[num_steps + 1]`` fp32 noise levels of ``FluxPipeline``: ``linspace(1, 1/T, T)`` handed to the pipeline's
    ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=..., mu=mu)``, then the appended 0.

    The scheduler itself does the shifting (exponential ``e^mu / (e^mu + 1/σ - 1)`` with dynamic shifting, which is
    SD3's static shift with ``s = e^mu``; the config's static ``shift`` otherwise), so every scheduler option the
    model ships with is honoured exactly.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler: Any = FlowMatchEulerDiscreteScheduler.from_config(dict(scheduler_config))  # type: ignore[no-untyped-call]
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu, device="cpu")
    sigmas: Tensor = scheduler.sigmas.to(torch.float32)
    return sigmas


class FluxPolicy(DiffusersTransformerPolicy):
    """FLUX.1 (rectified-flow MMDiT with packed latents) loaded with ``FluxPipeline.from_pretrained``.

    Args:
        pretrained: Hub id (e.g. ``black-forest-labs/FLUX.1-dev``, resolved from the local HF cache), a local
            pipeline directory, or ``tiny-random[:SEED]`` (a tiny random-weight FLUX built on first use).
        dtype: Weight dtype. ``auto`` = bfloat16 on CUDA, float32 on CPU. Means and log-probs are fp32 either way.
        resolution: Image height and width in pixels (a multiple of 2 x the VAE factor: 16 for FLUX.1).
        guidance_scale: FLUX.1-dev's distilled guidance, fed to the transformer's guidance embedding (one forward
            per row; there is no classifier-free guidance pass). Ignored by models without a guidance embedding
            (FLUX.1-schnell). FluxPipeline's default and DanceGRPO's value: 3.5.
        lora: Train a LoRA adapter on the transformer with these settings; ``null`` for none.
        full_finetune: Train every transformer parameter instead of a LoRA adapter.
        gradient_checkpointing: Recompute transformer activations in the backward pass to save memory.
        reference: Keep a frozen reference model for KL terms. LoRA always has one for free (adapter disabled);
            full fine-tuning needs this flag and keeps a frozen copy of the transformer.
        max_sequence_length: T5 tokens per prompt (FluxPipeline's default 512).
        local_files_only: Never contact the hub; hub ids must already be in the local cache.
        time_grid: ``"diffusers"`` (default): ``FluxPipeline``'s grid, ``linspace(1, 1/T, T)`` shifted with
            ``mu`` from the image sequence length (resolution-dependent). ``"shifted-linspace"``:
            ``time_shift(linspace(1, 0, T+1), shift)``, DanceGRPO's and MixGRPO's static grid. See
            ``docs/models.md`` "Time grids".
        shift: Static shift of ``"shifted-linspace"`` (``null``: the scheduler config's ``shift``, 3.0 for FLUX.1,
            which is DanceGRPO's and MixGRPO's ``--shift 3``). Must be ``null`` with ``"diffusers"``, whose shift is
            ``e^mu``.
    """

    name: ClassVar[str] = "flux"
    pipeline_class: ClassVar[str] = "FluxPipeline"
    required_components: ClassVar[tuple[str, ...]] = (
        "transformer",
        "vae",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
    )
    weighted_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "text_encoder", "text_encoder_2")

    def __init__(
        self,
        pretrained: str,
        dtype: DTypeName = "auto",
        resolution: Annotated[int, Range(gt=0)] = 512,
        guidance_scale: Annotated[float, Range(ge=0)] = 3.5,
        lora: LoraSpec | None = None,
        full_finetune: bool = False,
        gradient_checkpointing: bool = False,
        reference: bool = False,
        max_sequence_length: Annotated[int, Range(ge=1)] = 512,
        local_files_only: bool = True,
        time_grid: TimeGrid = "diffusers",
        shift: Annotated[float, Range(gt=0)] | None = None,
    ) -> None:
        super().__init__(
            pretrained,
            dtype=dtype,
            resolution=resolution,
            guidance_scale=guidance_scale,
            lora=lora,
            full_finetune=full_finetune,
            gradient_checkpointing=gradient_checkpointing,
            reference=reference,
            max_sequence_length=max_sequence_length,
            local_files_only=local_files_only,
            time_grid=time_grid,
            shift=shift,
        )
        self._img_ids: Tensor | None = None
        self._sigmas: dict[int, Tensor] = {}

    # ------------------------------------------------------------------------------------------------ set-up

    def clean_tail_steps(self) -> int:
        """Both FLUX grids end ``shift(1/T) -> 0`` (no ``σ_min`` level): only the final step lands on a clean level."""
        return 1

    def validate(self, recipe: Any) -> list[str]:
        """Check the settings, the model directory (local, or a hub id's snapshot in the local cache: its pipeline
        class, components and configs) and that the resolution fits the VAE factor (read from its config) and the
        2x2 packing, without loading weights."""
        problems = self._setting_problems()
        if self.shift is not None and self.time_grid == "diffusers":
            problems.append(
                "model.init_args.shift: the 'diffusers' FLUX grid shifts by e^mu from the resolution; set "
                "shift only with time_grid 'shifted-linspace' (or leave it null)"
            )
        try:
            directory = self._pretrained_dir()
            if directory is not None:
                vae_factor: int | None = vae_block_factor(directory)
            elif parse_tiny_id(self.pretrained) is not None:
                vae_factor = TINY_VAE_FACTOR  # built on first use from known configs (models/tiny.py)
            else:
                vae_factor = None  # a hub id setup() may download: nothing local to read
        except (ValueError, ModelDirError) as e:
            return [*problems, f"model.init_args.pretrained: {e}"]
        return problems + ([] if vae_factor is None else self._resolution_problems(vae_factor))

    def _resolution_problems(self, vae_factor: int) -> list[str]:
        factor = 2 * vae_factor
        if self.resolution % factor:
            return [
                f"model.init_args.resolution: {self.resolution} is not a multiple of {factor} "
                f"(VAE factor {vae_factor} x 2x2 latent packing)"
            ]
        return []

    def setup(self, device: torch.device) -> None:
        """Load the pipeline, move it to ``device`` in the weight dtype and prepare LoRA / full FT / reference.

        Raises:
            ModelDirError: The local directory is missing or malformed (the message names what is missing).
            OSError: diffusers could not load the model (wrapped with the path or hub id).
            ValueError: The resolution does not fit the VAE and the 2x2 packing.
        """
        pipe = self._load_pipeline(device)
        self._prepare(pipe, pipe.vae_scale_factor * 2, "VAE factor x 2x2 latent packing")
        h, w = self.latent_shape[1:]
        # FluxPipeline._prepare_latent_image_ids: (0, row, col) per 2x2 token, in the transformer's dtype.
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        self._img_ids = ids.reshape(-1, 3).to(self.device, self._dtype)
        self._sigmas.clear()

    def _build_tiny(self, seed: int) -> Path:
        return ensure_tiny_flux(seed)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H/f, W/f)`` of one *unpacked* latent (``C`` = transformer channels / 4)."""
        f = self.pipe.vae_scale_factor
        side = 2 * (self.resolution // (2 * f))
        return (self.transformer.config.in_channels // 4, side, side)

    @property
    def image_seq_len(self) -> int:
        """Number of packed image tokens, ``(H/2f)·(W/2f)``: what ``mu`` is computed from."""
        _, h, w = self.latent_shape
        return (h // 2) * (w // 2)

    @property
    def mu(self) -> float:
        """The resolution-dependent shift parameter of the ``"diffusers"`` grid (:func:`flux_mu`)."""
        return flux_mu(self.image_seq_len, self.pipe.scheduler.config)

    # ------------------------------------------------------------------------------------------------ policy

    def sigmas(self, num_steps: int) -> Tensor:
        """``"diffusers"``: exactly ``FluxPipeline``'s sigmas at this resolution (:func:`flux_sigmas` with
        :attr:`mu`); ``"shifted-linspace"``: DanceGRPO's/MixGRPO's static grid with ``shift`` (else the config's)."""
        cfg = self.pipe.scheduler.config
        if self.time_grid == "diffusers":
            if num_steps not in self._sigmas:  # a scheduler per call is cheap, but samplers ask every rollout
                self._sigmas[num_steps] = flux_sigmas(num_steps, self.mu, cfg)
            return self._sigmas[num_steps].to(self.device, copy=True)
        shift = float(cfg.shift) if self.shift is None else self.shift
        return shifted_linspace_sigmas(num_steps, shift).to(self.device)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts with the pipeline's ``encode_prompt`` (CLIP pooled + T5), cached per prompt string.

        ``Conditioning.tensors`` holds ``prompt_embeds`` ``[B, L, D]`` (T5) and ``pooled_prompt_embeds`` ``[B, P]``
        (CLIP). ``text_ids`` are all zeros and rebuilt from ``L`` in :meth:`velocity`.
        """
        return Conditioning(self._cache.get(list(prompts), self._encode_batch))

    @torch.no_grad()
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, pp, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": pe, "pooled_prompt_embeds": pp}

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        """Velocity at ``(latents, σ)`` in fp32, image-shaped like ``latents``.

        Packs the latents into 2x2 tokens, calls the transformer with ``timestep = (1000·σ)/1000`` (as the pipeline
        rounds it), the guidance scale (guidance-distilled models) and the position ids, and unpacks the output.

        Args:
            latents: ``[B, C, h, w]`` states.
            sigma: ``[B]`` noise levels.
            cond: ``B`` rows of conditioning from :meth:`encode` (``Conditioning.select``).
        """
        b, _, h, w = latents.shape
        t = cond.tensors
        if t["prompt_embeds"].shape[0] != b:
            raise ValueError(f"velocity: {b} latents but {t['prompt_embeds'].shape[0]} conditioning rows")
        if self._img_ids is None:
            raise RuntimeError("FluxPolicy.setup(device) has not been called")
        sigma = sigma.to(self.device, torch.float32).reshape(-1).expand(b)
        tokens = pack_latents(latents.to(self.device, self._dtype))
        # FluxPipeline: t = 1000·σ (fp32), cast to the latents' dtype, then divided by 1000.
        timestep = timesteps_from_sigmas(sigma).to(self._dtype) / 1000
        transformer = self._active_transformer()
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance_scale, device=self.device, dtype=torch.float32)
        enc = t["prompt_embeds"].to(self._dtype)
        txt_ids = torch.zeros(enc.shape[1], 3, device=self.device, dtype=self._dtype)
        out: Tensor = transformer(
            hidden_states=tokens,
            timestep=timestep,
            guidance=guidance,
            pooled_projections=t["pooled_prompt_embeds"].to(self._dtype),
            encoder_hidden_states=enc,
            txt_ids=txt_ids,
            img_ids=self._img_ids,
            return_dict=False,
        )[0]
        self.forward_count += b
        return unpack_latents(out, h, w).float()


@hookimpl
def rlpost_register_models(register: Registry[Policy]) -> None:
    """Register :class:`FluxPolicy` (short name ``flux``)."""
    register(FluxPolicy)
