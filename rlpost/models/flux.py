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
from typing import Annotated, ClassVar

import torch
from torch import Tensor

from rlpost.core.api import Conditioning, Policy, Range, resolve_guidance
from rlpost.core.hookspecs import hookimpl
from rlpost.core.registry import Registry
from rlpost.models.adapter_settings import DTypeName, LoraSpec
from rlpost.models.packed_latents import PackedLatentPolicy, flux_mu, flux_sigmas, pack_latents, unpack_latents
from rlpost.models.pipeline_dir import vae_block_factor
from rlpost.models.tiny import TINY_VAE_FACTOR, ensure_tiny_flux
from rlpost.ops.schedules import TimeGrid

# The packing and grid functions live in rlpost.models.packed_latents (shared with Qwen-Image); named here too, where
# FLUX's tests and users have always imported them from.
__all__ = ["FluxPolicy", "flux_mu", "flux_sigmas", "pack_latents", "rlpost_register_models", "unpack_latents"]


class FluxPolicy(PackedLatentPolicy):
    """FLUX.1 (rectified-flow MMDiT with packed latents) loaded with ``FluxPipeline.from_pretrained``.

    Args:
        pretrained: Hub id (e.g. ``black-forest-labs/FLUX.1-dev``, resolved from the local HF cache), a local
            pipeline directory, or ``tiny-random[:SEED]`` (a tiny random-weight FLUX built on first use).
        dtype: Weight dtype. ``auto`` = bfloat16 on CUDA, float32 on CPU. Means and log-probs are fp32 either way.
        resolution: Image height and width in pixels (a multiple of 2 x the VAE factor: 16 for FLUX.1).
        guidance_scale: FLUX.1-dev's distilled guidance, fed to the transformer's guidance embedding (one forward
            per row; there is no classifier-free guidance pass); a ``velocity`` call's ``guidance`` replaces it for
            that call. Ignored by models without a guidance embedding (FLUX.1-schnell). FluxPipeline's default and
            DanceGRPO's value: 3.5.
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
    gated_repos: ClassVar[frozenset[str]] = frozenset({"black-forest-labs/FLUX.1-dev"})
    """Released checkpoints behind a licence click-through on their model pages (the community licence)."""
    weighted_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "text_encoder", "text_encoder_2")
    family: ClassVar[str] = "FLUX"
    tiny_vae_factor: ClassVar[int] = TINY_VAE_FACTOR  # built on first use from known configs (models/tiny.py)

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

    # ------------------------------------------------------------------------------------------------ set-up

    def clean_tail_steps(self) -> int:
        """Both FLUX grids end ``shift(1/T) -> 0`` (no ``σ_min`` level): only the final step lands on a clean level."""
        return 1

    def _vae_factor_of(self, directory: Path) -> int:
        return vae_block_factor(directory)

    def setup(self, device: torch.device) -> None:
        """:meth:`PackedLatentPolicy.setup`, then the image tokens' position ids (raises what it raises)."""
        super().setup(device)
        h, w = self.latent_shape[1:]
        # FluxPipeline._prepare_latent_image_ids: (0, row, col) per 2x2 token, in the transformer's dtype.
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        self._img_ids = ids.reshape(-1, 3).to(self.device, self._dtype)

    def _build_tiny(self, seed: int) -> Path:
        return ensure_tiny_flux(seed)

    # ------------------------------------------------------------------------------------------------ policy

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

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None = None) -> Tensor:
        """Velocity at ``(latents, σ)`` in fp32, image-shaped like ``latents``.

        Packs the latents into 2x2 tokens, calls the transformer with ``timestep = (1000·σ)/1000`` (as the pipeline
        rounds it), the guidance scale (guidance-distilled models) and the position ids, and unpacks the output.

        Args:
            latents: ``[B, C, h, w]`` states.
            sigma: ``[B]`` noise levels.
            cond: ``B`` rows of conditioning from :meth:`encode` (``Conditioning.select``).
            guidance: FLUX.1 has no classifier-free guidance pass: every call is one forward over the ``B`` rows, and
                the value sets the distilled guidance embedding instead of ``guidance_scale`` (``None``: keep it;
                ``1.0``: the distilled model's unguided, conditional velocity; ``g > 1``: its approximation of CFG
                at ``g``; no negative prompt is needed). A model without a guidance embedding (FLUX.1-schnell)
                ignores it, as it ignores ``guidance_scale``.

        Raises:
            ValueError: A ``guidance`` below 1 or not finite, or mismatched conditioning rows.
        """
        _, _, h, w = latents.shape
        t = cond.tensors
        tokens, timestep = self._packed_inputs(latents, sigma, cond)
        if self._img_ids is None:
            raise RuntimeError("FluxPolicy.setup(device) has not been called")
        b = tokens.shape[0]
        scale = resolve_guidance(guidance, self.guidance_scale, can_guide=True)
        transformer = self._active_transformer()
        embedded = None
        if transformer.config.guidance_embeds:
            embedded = torch.full((b,), scale, device=self.device, dtype=torch.float32)
        enc = t["prompt_embeds"].to(self._dtype)
        txt_ids = torch.zeros(enc.shape[1], 3, device=self.device, dtype=self._dtype)
        out: Tensor = transformer(
            hidden_states=tokens,
            timestep=timestep,
            guidance=embedded,
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
