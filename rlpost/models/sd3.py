"""Stable Diffusion 3 / 3.5 as an rlpost :class:`~rlpost.core.api.Policy`, on the real diffusers stack.

Everything SD3 specific lives here: loading ``StableDiffusion3Pipeline``, prompt encoding with its three text
encoders, the ``SD3Transformer2DModel`` call signature, the latent shape and the VAE scaling/shift. Samplers see only
``sigmas`` / ``initial_noise`` / ``encode`` / ``velocity`` / ``decode``; the FLUX adapter (``rlpost/models/flux.py``)
is another module of this shape (see ``docs/models.md``).

With the Euler ODE kernel and the default ``time_grid="diffusers"``, sampling through this adapter reproduces
``StableDiffusion3Pipeline.__call__`` exactly (same schedule, timestep ``1000·σ``, the pipeline's CFG formula and
``[negative, positive]`` batch order); the test suite checks this on a tiny model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch
from torch import Tensor

from rlpost.core.api import Conditioning, Policy, Range
from rlpost.core.hookspecs import hookimpl
from rlpost.core.registry import Registry
from rlpost.models._common import DiffusersTransformerPolicy
from rlpost.models.adapter_settings import DTypeName, LoraSpec
from rlpost.models.pipeline_dir import ModelDirError, patch_grid_problems, resolution_problems
from rlpost.models.tiny import TINY_SD3_GEOMETRY, ensure_tiny_sd3, parse_tiny_id
from rlpost.ops.schedules import TIME_GRIDS, TimeGrid, clean_tail_steps, time_grid_sigmas, timesteps_from_sigmas

__all__ = ["LoraSpec", "SD3Policy", "rlpost_register_models"]


class SD3Policy(DiffusersTransformerPolicy):
    """Stable Diffusion 3/3.5 (MMDiT, rectified flow) loaded with ``StableDiffusion3Pipeline.from_pretrained``.

    Args:
        pretrained: Hub id (e.g. ``stabilityai/stable-diffusion-3.5-medium``, resolved from the local HF cache) or a
            local pipeline directory (with ``model_index.json`` and one subfolder per component).
        dtype: Weight dtype. ``auto`` = bfloat16 on CUDA, float32 on CPU. Means and log-probs are fp32 either way.
        resolution: Image height and width in pixels (a multiple of VAE factor × patch size).
        guidance_scale: Classifier-free guidance scale; ``> 1`` turns CFG on (doubling the transformer batch).
        negative_prompt: Prompt for the unconditional branch of CFG.
        lora: Train a LoRA adapter on the transformer with these settings; ``null`` for none.
        full_finetune: Train every transformer parameter instead of a LoRA adapter.
        gradient_checkpointing: Recompute transformer activations in the backward pass to save memory.
        reference: Keep a frozen reference model for KL terms. LoRA always has one for free (adapter disabled);
            full fine-tuning needs this flag and keeps a frozen copy of the transformer.
        max_sequence_length: T5 tokens per prompt (SD3 default 256; fewer is faster).
        local_files_only: Never contact the hub; hub ids must already be in the local cache.
        time_grid: Noise levels every sampler and the held-out evaluation step through (:meth:`sigmas`):
            ``"diffusers"`` (default; the pipeline's own ``FlowMatchEulerDiscreteScheduler`` grid, used by Flow-GRPO
            and TreeGRPO) or ``"shifted-linspace"`` (``time_shift(linspace(1, 0, T+1))``, used by DanceGRPO and
            MixGRPO). See ``docs/models.md`` "Time grids".
        shift: Static time shift of the grid; ``null`` takes the scheduler config's ``shift`` (SD3.5: 3.0).
    """

    name: ClassVar[str] = "sd3"
    pipeline_class: ClassVar[str] = "StableDiffusion3Pipeline"
    required_components: ClassVar[tuple[str, ...]] = (
        "transformer",
        "vae",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
    )
    gated_repos: ClassVar[frozenset[str]] = frozenset(
        {
            "stabilityai/stable-diffusion-3.5-medium",
            "stabilityai/stable-diffusion-3.5-large",
            "stabilityai/stable-diffusion-3-medium-diffusers",
        }
    )
    """Released checkpoints behind a licence click-through on their model pages (the community licence)."""
    weighted_components: ClassVar[tuple[str, ...]] = (
        "transformer",
        "vae",
        "text_encoder",
        "text_encoder_2",
        "text_encoder_3",
    )

    def __init__(
        self,
        pretrained: str,
        dtype: DTypeName = "auto",
        resolution: Annotated[int, Range(gt=0)] = 512,
        guidance_scale: Annotated[float, Range()] = 4.5,
        negative_prompt: str = "",
        lora: LoraSpec | None = None,
        full_finetune: bool = False,
        gradient_checkpointing: bool = False,
        reference: bool = False,
        max_sequence_length: Annotated[int, Range(ge=1)] = 256,
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
        self.negative_prompt = negative_prompt

    # ------------------------------------------------------------------------------------------------ set-up

    @property
    def do_cfg(self) -> bool:
        """Whether classifier-free guidance is on (``guidance_scale > 1``, the pipeline's rule)."""
        return self.guidance_scale > 1.0

    def clean_tail_steps(self) -> int | None:
        """Final steps of the recipe's grid that land on a (near-)clean level (:func:`clean_tail_steps`); ``None``
        for an unknown grid name (``validate`` reports that)."""
        return clean_tail_steps(self.time_grid) if self.time_grid in TIME_GRIDS else None

    def validate(self, recipe: Any) -> list[str]:
        """Check the settings, the model directory (local, or a hub id's snapshot in the local cache: its pipeline
        class, components and configs) and that the resolution fits the model's VAE factor x patch size and
        positional embedding, read from its configs without loading weights."""
        problems = self._setting_problems()
        try:
            directory = self._pretrained_dir()
            if directory is not None:
                fit = resolution_problems(directory, self.resolution)
            elif parse_tiny_id(self.pretrained) is not None:  # built on first use from known configs
                fit = patch_grid_problems(self.resolution, *TINY_SD3_GEOMETRY)
            else:
                fit = []  # a hub id setup() may download: nothing local to read
        except (ValueError, ModelDirError) as e:
            return [*problems, f"model.init_args.pretrained: {e}"]
        return problems + [f"model.init_args.resolution: {p}" for p in fit]

    def setup(self, device: torch.device) -> None:
        """Load the pipeline, move it to ``device`` in the weight dtype and prepare LoRA / full FT / reference.

        Raises:
            ModelDirError: The local directory is missing or malformed (the message names what is missing).
            OSError: diffusers could not load the model (wrapped with the path or hub id).
            ValueError: The scheduler uses dynamic time shifting, or the resolution does not fit the model.
        """
        pipe = self._load_pipeline(device)
        if pipe.scheduler.config.get("use_dynamic_shifting", False):
            raise ValueError(f"{self.pretrained!r}: dynamic (resolution-dependent) time shifting is not supported")
        self._prepare(pipe, pipe.vae_scale_factor * pipe.transformer.config.patch_size, "VAE factor x patch size")

    def _build_tiny(self, seed: int) -> Path:
        return ensure_tiny_sd3(seed)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H/f, W/f)`` of one latent."""
        f = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, self.resolution // f, self.resolution // f)

    # ------------------------------------------------------------------------------------------------ policy

    def sigmas(self, num_steps: int) -> Tensor:
        """The recipe's time grid with the static shift (``shift``, else the scheduler config's).

        With ``time_grid="diffusers"`` this is exactly ``FlowMatchEulerDiscreteScheduler.sigmas`` (so the Euler ODE
        reproduces the pipeline); ``"shifted-linspace"`` is DanceGRPO's and MixGRPO's grid
        (:func:`rlpost.ops.schedules.time_grid_sigmas`).
        """
        cfg = self.pipe.scheduler.config
        shift = float(cfg.shift) if self.shift is None else self.shift
        return time_grid_sigmas(self.time_grid, num_steps, shift, int(cfg.num_train_timesteps)).to(self.device)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts with the pipeline's ``encode_prompt`` (CLIP-L, CLIP-G, T5), cached per prompt string.

        ``Conditioning.tensors`` holds ``prompt_embeds`` ``[B, L, D]`` and ``pooled_prompt_embeds`` ``[B, P]``, plus
        ``negative_prompt_embeds`` / ``negative_pooled_prompt_embeds`` when CFG is on.
        """
        return Conditioning(self._cache.get(list(prompts), self._encode_batch))

    @torch.no_grad()
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, npe, pp, npp = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=self.do_cfg,
            negative_prompt=[self.negative_prompt] * len(prompts) if self.do_cfg else None,
            max_sequence_length=self.max_sequence_length,
        )
        out = {"prompt_embeds": pe, "pooled_prompt_embeds": pp}
        if self.do_cfg:
            out |= {"negative_prompt_embeds": npe, "negative_pooled_prompt_embeds": npp}
        return out

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None = None) -> Tensor:
        """Velocity at ``(latents, σ)`` with CFG ``v_u + g·(v_c - v_u)`` (the pipeline's formula), in fp32.

        Args:
            latents: ``[B, C, h, w]`` states.
            sigma: ``[B]`` noise levels; the transformer gets ``timestep = 1000·σ``.
            cond: ``B`` rows of conditioning from :meth:`encode` (``Conditioning.select``).
            guidance: ``None``: ``guidance_scale``; ``1.0``: the conditional rows alone (one pass over ``B`` rows);
                ``g > 1``: CFG at ``g`` (needs ``guidance_scale > 1``, so that ``encode`` computed the negative rows).

        Raises:
            ValueError: A ``guidance`` below 1 or not finite, or above 1 when ``guidance_scale`` is not.
        """
        b = latents.shape[0]
        t = cond.tensors
        if t["prompt_embeds"].shape[0] != b:
            raise ValueError(f"velocity: {b} latents but {t['prompt_embeds'].shape[0]} conditioning rows")
        scale = self._cfg_scale(guidance)
        sigma = sigma.to(self.device, torch.float32).reshape(-1).expand(b)
        x = latents.to(self.device, self._dtype)
        timestep = timesteps_from_sigmas(sigma)
        enc, pooled = t["prompt_embeds"], t["pooled_prompt_embeds"]
        if scale > 1.0:
            # Same batch layout as StableDiffusion3Pipeline: [uncond rows; cond rows].
            x = torch.cat([x, x])
            timestep = torch.cat([timestep, timestep])
            enc = torch.cat([t["negative_prompt_embeds"], enc])
            pooled = torch.cat([t["negative_pooled_prompt_embeds"], pooled])
        out: Tensor = self._active_transformer()(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=enc.to(self._dtype),
            pooled_projections=pooled.to(self._dtype),
            return_dict=False,
        )[0]
        self.forward_count += b
        if scale > 1.0:
            uncond, text = out.chunk(2)
            if self._dtype != torch.float32:
                uncond, text = uncond.float(), text.float()
            out = uncond + scale * (text - uncond)
        return out.float()


@hookimpl
def rlpost_register_models(register: Registry[Policy]) -> None:
    """Register :class:`SD3Policy` (short name ``sd3``)."""
    register(SD3Policy)
