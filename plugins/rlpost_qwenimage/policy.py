"""Qwen-Image as an rlpost :class:`~rlpost.Policy`, on the real diffusers stack, written against the facade only.

Everything Qwen-Image specific lives here: loading ``QwenImagePipeline``, prompt encoding (Qwen2.5-VL hidden states
of the chat-templated prompt with the template tokens dropped, variable length with a mask), the
``QwenImageTransformer2DModel`` call (2x2-packed latent tokens, ``img_shapes`` for its RoPE, the text mask, timestep
``σ``), true classifier-free guidance with the pipeline's norm rescaling, the resolution-dependent time shift and the
Wan-style 3-D VAE applied to one frame with its per-channel latent normalisation.

The seam is the one SD3 and FLUX use: samplers and kernels see image-shaped latents ``[B, C, H/f, W/f]``; packing
into ``[B, (H/2f)(W/2f), 4C]`` tokens happens inside :meth:`QwenImagePolicy.velocity` and is undone before it
returns, and the VAE's frame axis is added and removed inside :meth:`QwenImagePolicy.decode`.

With the Euler ODE kernel and the default ``time_grid="diffusers"``, sampling through this adapter reproduces
``QwenImagePipeline.__call__`` (diffusers 0.42.1 ``pipelines/qwenimage/pipeline_qwenimage.py``); the plugin's tests
check this on the tiny model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from rlpost import (
    TIME_GRIDS,
    Conditioning,
    DTypeName,
    LoraSpec,
    PackedLatentPolicy,
    Range,
    TimeGrid,
    clean_tail_steps,
    read_config,
    unpack_latents,
)
from rlpost_qwenimage.tiny import TINY_VAE_FACTOR, ensure_tiny_qwenimage

__all__ = ["MAX_SEQUENCE_LENGTH", "QwenImagePolicy"]

MAX_SEQUENCE_LENGTH = 1024
"""The longest prompt embedding ``QwenImagePipeline`` accepts (``check_inputs``; its ``tokenizer_max_length``)."""


def _vae_factor(directory: Path) -> int:
    """``QwenImagePipeline.vae_scale_factor`` (``2 ** len(vae.temperal_downsample)``) from ``vae/config.json``.

    Raises:
        OSError: The config is missing, unreadable or not a JSON object (``rlpost.read_config`` names the file).
        ValueError: It has no ``temperal_downsample`` list.
    """
    flags = read_config(directory, "vae").get("temperal_downsample")
    if not isinstance(flags, list):
        file = directory / "vae" / "config.json"
        raise ValueError(f"{str(file)!r} has no temperal_downsample list (the VAE factor is 2 ** its length)")
    return int(2 ** len(flags))


def _pad_to(x: Tensor, length: int) -> Tensor:
    """Zero-pad dimension 1 of ``x`` (``[B, L]`` or ``[B, L, D]``) to ``length``."""
    pad = length - x.shape[1]
    return F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))


def _stack_rows(rows: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``[L_i, D]`` rows as ``[B, max L_i, D]`` zero-padded embeddings and their ``[B, max L_i]`` 0/1 mask."""
    length = max(r.shape[0] for r in rows)
    embeds = torch.stack([_pad_to(r[None], length)[0] for r in rows])
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=embeds.device)
    for i, r in enumerate(rows):
        mask[i, : r.shape[0]] = 1
    return embeds, mask


class QwenImagePolicy(PackedLatentPolicy):
    """Qwen-Image (double-stream MMDiT over a Qwen2.5-VL text encoder) loaded with ``QwenImagePipeline``.

    Args:
        pretrained: Hub id (``Qwen/Qwen-Image``, resolved from the local HF cache), a local pipeline directory, or
            ``tiny-random[:SEED]`` (a tiny random-weight Qwen-Image built on first use).
        dtype: Weight dtype. ``auto`` = bfloat16 on CUDA, float32 on CPU. Means and log-probs are fp32 either way.
        resolution: Image height and width in pixels (a multiple of 2 x the VAE factor: 16 for Qwen-Image).
        true_cfg_scale: Classifier-free guidance scale ``w`` of QwenImagePipeline (``true_cfg_scale``); ``> 1`` turns
            guidance on (one more transformer row per row, with ``negative_prompt``) for rollouts; a ``velocity``
            call's ``guidance`` replaces it for that call. The pipeline's default and the Qwen-Image model card's
            value: 4.0.
        negative_prompt: Prompt of the unconditional branch (the model card's ``" "``: "an empty string if you do
            not have a specific concept to remove").
        lora: Train a LoRA adapter on the transformer with these settings; ``null`` for none.
        full_finetune: Train every transformer parameter instead of a LoRA adapter.
        gradient_checkpointing: Recompute transformer activations in the backward pass to save memory.
        reference: Keep a frozen reference model for KL terms. LoRA always has one for free (adapter disabled);
            full fine-tuning needs this flag and keeps a frozen copy of the transformer.
        max_sequence_length: Prompt tokens kept after the template (QwenImagePipeline's default 512, at most 1024).
        local_files_only: Never contact the hub; hub ids must already be in the local cache.
        time_grid: ``"diffusers"`` (default): QwenImagePipeline's grid, ``linspace(1, 1/T, T)`` shifted with ``mu``
            from the image sequence length and stretched to end at the scheduler's ``shift_terminal`` (0.02).
            ``"shifted-linspace"``: ``time_shift(linspace(1, 0, T+1), shift)``, DanceGRPO's and MixGRPO's static grid.
        shift: Static shift of ``"shifted-linspace"`` (``null``: the scheduler config's ``shift``, 1.0 for
            Qwen-Image, i.e. no shift; DanceGRPO's FLUX runs use 3). Must be ``null`` with ``"diffusers"``.
    """

    name: ClassVar[str] = "qwen-image"
    pipeline_class: ClassVar[str] = "QwenImagePipeline"
    required_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
    weighted_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "text_encoder")
    family: ClassVar[str] = "Qwen-Image"
    tiny_vae_factor: ClassVar[int] = TINY_VAE_FACTOR  # built on first use from known configs (rlpost_qwenimage.tiny)

    def __init__(
        self,
        pretrained: str,
        dtype: DTypeName = "auto",
        resolution: Annotated[int, Range(gt=0)] = 512,
        true_cfg_scale: Annotated[float, Range()] = 4.0,
        negative_prompt: str = " ",
        lora: LoraSpec | None = None,
        full_finetune: bool = False,
        gradient_checkpointing: bool = False,
        reference: bool = False,
        max_sequence_length: Annotated[int, Range(ge=1, le=MAX_SEQUENCE_LENGTH)] = 512,
        local_files_only: bool = True,
        time_grid: TimeGrid = "diffusers",
        shift: Annotated[float, Range(gt=0)] | None = None,
    ) -> None:
        super().__init__(
            pretrained,
            dtype=dtype,
            resolution=resolution,
            guidance_scale=true_cfg_scale,
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
        self._rows: dict[str, Tensor] = {}  # per prompt string: its [L, D] embedding, padding removed

    # ------------------------------------------------------------------------------------------------ set-up

    @property
    def true_cfg_scale(self) -> float:
        """The guidance scale ``w`` (stored as the base class's ``guidance_scale``)."""
        return self.guidance_scale

    @property
    def do_cfg(self) -> bool:
        """Whether guidance is on: ``true_cfg_scale > 1`` (the pipeline's rule, a negative prompt always given)."""
        return self.guidance_scale > 1.0

    @property
    def frames(self) -> int:
        """Frames per sample: 1 (an image; :meth:`decode` returns ``[B, 1, H, W, 3]``)."""
        return 1

    def clean_tail_steps(self) -> int | None:
        """``"diffusers"``: 2 — the grid is stretched so its last nonzero level is ``shift_terminal`` (0.02), a
        near-clean level like SD3's ``σ_min``; ``"shifted-linspace"``: 1. ``None`` for an unknown grid name."""
        return clean_tail_steps(self.time_grid) if self.time_grid in TIME_GRIDS else None

    def _vae_factor_of(self, directory: Path) -> int:
        return _vae_factor(directory)

    def setup(self, device: torch.device) -> None:
        """:meth:`rlpost.PackedLatentPolicy.setup` (raises what it raises), with the prompt cache emptied."""
        super().setup(device)
        self._rows.clear()

    def _build_tiny(self, seed: int) -> Path:
        return ensure_tiny_qwenimage(seed)

    # ------------------------------------------------------------------------------------------------ policy

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts with the pipeline's ``encode_prompt``, cached per prompt string.

        ``Conditioning.tensors`` holds ``prompt_embeds`` ``[B, L, D]`` (zero-padded to the longest prompt of the call)
        and ``prompt_embeds_mask`` ``[B, L]`` (1 on a prompt's tokens), plus ``negative_prompt_embeds`` /
        ``negative_prompt_embeds_mask`` (the negative prompt, one row per prompt) when guidance is on.
        """
        prompts = list(prompts)
        if not prompts:
            raise ValueError("encode() needs at least one prompt")
        wanted = prompts + [self.negative_prompt] if self.do_cfg else prompts
        missing = list(dict.fromkeys(p for p in wanted if p not in self._rows))
        if missing:
            self._rows.update(zip(missing, self._encode_batch(missing), strict=True))
        embeds, mask = _stack_rows([self._rows[p] for p in prompts])
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if self.do_cfg:
            neg = self._rows[self.negative_prompt]
            n = neg.shape[0]
            out["negative_prompt_embeds"] = neg[None].expand(len(prompts), n, neg.shape[1])
            out["negative_prompt_embeds_mask"] = torch.ones(len(prompts), n, dtype=torch.long, device=neg.device)
        return Conditioning(out)

    @torch.no_grad()
    def _encode_batch(self, prompts: list[str]) -> list[Tensor]:
        """Each prompt's ``[L_i, D]`` embedding: the pipeline's batch output with its padding cut off (right-padded,
        causal text encoder: a prompt's hidden states do not depend on the others in the batch)."""
        embeds, mask = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, num_images_per_prompt=1, max_sequence_length=self.max_sequence_length
        )
        lengths = [embeds.shape[1]] * len(prompts) if mask is None else mask.sum(dim=1).tolist()
        return [embeds[i, : int(n)].detach() for i, n in enumerate(lengths)]

    def _text_inputs(self, t: dict[str, Tensor], cfg: bool) -> tuple[Tensor, Tensor | None]:
        """Encoder states and mask of the transformer batch (``[negative; prompt]`` rows with guidance, ``cfg``),
        trimmed to the longest row; the mask is ``None`` when no row is padded, as the pipeline passes it."""
        enc, mask = t["prompt_embeds"], t["prompt_embeds_mask"]
        if cfg:
            neg, neg_mask = t["negative_prompt_embeds"], t["negative_prompt_embeds_mask"]
            length = max(enc.shape[1], neg.shape[1])
            enc = torch.cat([_pad_to(neg, length), _pad_to(enc, length)])
            mask = torch.cat([_pad_to(neg_mask, length), _pad_to(mask, length)])
        keep = int(mask.sum(dim=1).max())
        enc, mask = enc[:, :keep].to(self.device, self._dtype), mask[:, :keep].to(self.device)
        return enc, None if bool(mask.all()) else mask

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None = None) -> Tensor:
        """Velocity at ``(latents, σ)`` in fp32, image-shaped like ``latents``.

        Packs the latents into 2x2 tokens and calls the transformer with ``timestep = (1000·σ)/1000`` (as the
        pipeline rounds it), ``img_shapes`` (one frame of ``(h/2, w/2)`` tokens) and the text mask. With guidance the
        negative and prompt rows go through one batched forward (as Flow-GRPO's Qwen-Image pipeline does, ``yifan123/
        flow_grpo`` ``flow_grpo/diffusers_patch/qwenimage_pipeline_with_logprob.py``) and are combined as the
        pipeline does: ``c = v_u + w·(v_c - v_u)``, rescaled per token to the conditional prediction's norm,
        ``c·‖v_c‖/‖c‖`` (the norm over each token's packed channels).

        Args:
            latents: ``[B, C, h, w]`` states.
            sigma: ``[B]`` noise levels.
            cond: ``B`` rows of conditioning from :meth:`encode` (``Conditioning.select``).
            guidance: ``None``: ``true_cfg_scale``; ``1.0``: the prompt rows alone (one pass over ``B`` rows, no
                rescaling, as the pipeline at ``true_cfg_scale`` 1); ``w > 1``: guidance at ``w`` with the rescaling
                (needs ``true_cfg_scale > 1``, so that ``encode`` computed the negative rows).

        Raises:
            ValueError: A ``guidance`` below 1 or not finite, or above 1 when ``true_cfg_scale`` is not.
        """
        _, _, h, w = latents.shape
        tokens, timestep = self._packed_inputs(latents, sigma, cond)
        b = tokens.shape[0]
        scale = self._cfg_scale(guidance, "model.init_args.true_cfg_scale")
        enc, mask = self._text_inputs(cond.tensors, scale > 1.0)
        if scale > 1.0:
            tokens, timestep = torch.cat([tokens, tokens]), torch.cat([timestep, timestep])
        out: Tensor = self._active_transformer()(
            hidden_states=tokens,
            timestep=timestep,
            encoder_hidden_states=enc,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, h // 2, w // 2)]] * tokens.shape[0],
            return_dict=False,
        )[0]
        self.forward_count += b
        out = out.float()
        if scale > 1.0:
            uncond, text = out.chunk(2)
            combined = uncond + scale * (text - uncond)
            out = combined * (text.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        return unpack_latents(out, h, w)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """VAE-decode clean latents to ``[B, F, H, W, 3]`` uint8 frames on the device (``F = 1``).

        Undoes the per-channel normalisation (``x·latents_std + latents_mean``), adds the VAE's frame axis
        (``[B, C, 1, h, w]``), decodes and postprocesses as the pipeline does (``round(255·clamp(x/2 + ½))``).
        """
        vae = self.pipe.vae
        c = latents.shape[1]
        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=self.device).view(1, c, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=self.device).view(1, c, 1, 1, 1)
        x = latents.to(self.device, torch.float32)[:, :, None] * std + mean
        video: Tensor = vae.decode(x.to(vae.dtype), return_dict=False)[0].float()  # [B, 3, F, H, W]
        video = (video / 2 + 0.5).clamp(0, 1)
        return (video * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).contiguous()
