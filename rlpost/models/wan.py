"""Wan2.1 text-to-video as an rlpost :class:`~rlpost.core.api.Policy`, on the real diffusers stack.

Everything Wan specific lives here: loading ``WanPipeline``, prompt encoding (one UMT5 encoder, zero-padded to
``max_sequence_length``), the ``WanTransformer3DModel`` call with classifier-free guidance, the video latent layout
``[B, C, F_lat, H/8, W/8]`` with ``F_lat = (F - 1)/4 + 1``, the time grid, and VAE decoding to frames with the VAE's
per-channel ``latents_mean`` / ``latents_std``. Followed at diffusers 0.42.1: ``pipelines/wan/pipeline_wan.py``
(``WanPipeline.__call__``, ``encode_prompt``, ``prepare_latents``), ``models/transformers/transformer_wan.py`` and
``models/autoencoders/autoencoder_kl_wan.py``; ``video_processor.py`` for the frames' postprocessing.

The seam is the one SD3 and FLUX use, with a frame axis: samplers and kernels see ``[B, C, F_lat, h, w]`` latents
(what ``initial_noise`` draws, the shape ``WanPipeline.prepare_latents`` draws in), kernels reduce log-probs over every
non-batch dimension, and patchifying happens inside the transformer. :meth:`WanPolicy.decode` returns
``[B, F, H, W, 3]`` uint8 frames; :attr:`WanPolicy.frames` is ``F``.

With the Euler ODE kernel and ``time_grid="diffusers"`` on a model whose scheduler is a
``FlowMatchEulerDiscreteScheduler`` (the tiny build), sampling through this adapter reproduces ``WanPipeline.__call__``
from the same noise; the test suite checks this on a tiny model (``rlpost/models/tiny_wan.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch
from torch import Tensor

from rlpost.core.api import Conditioning, Policy, Range
from rlpost.core.hookspecs import hookimpl
from rlpost.core.registry import Registry
from rlpost.models._common import DiffusersTransformerPolicy
from rlpost.models.adapter_settings import DTypeName, LoraSpec
from rlpost.models.pipeline_dir import ModelDirError, read_config
from rlpost.models.tiny import parse_tiny_id
from rlpost.models.tiny_wan import TINY_WAN_TRANSFORMER, TINY_WAN_VAE, ensure_tiny_wan
from rlpost.models.wan_geometry import EULER_SCHEDULER, UNIPC_SCHEDULER, WanGeometry, wan_diffusers_sigmas
from rlpost.ops.schedules import TimeGrid, shifted_linspace_sigmas, timesteps_from_sigmas

__all__ = ["WanGeometry", "WanPolicy", "rlpost_register_models", "wan_diffusers_sigmas"]


class WanPolicy(DiffusersTransformerPolicy):
    """Wan2.1 text-to-video (flow-matching DiT, UMT5 text encoder, causal 3-D VAE) loaded with
    ``WanPipeline.from_pretrained``.

    Args:
        pretrained: Hub id (e.g. ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``, resolved from the local HF cache), a local
            pipeline directory, or ``tiny-random[:SEED]`` (a tiny random-weight Wan built on first use).
        dtype: Weight dtype. ``auto`` = bfloat16 on CUDA, float32 on CPU. Means and log-probs are fp32 either way.
        height: Frame height in pixels (a multiple of VAE factor x patch size: 16 for Wan2.1; 480 is its 480p).
        width: Frame width in pixels (same rule; 832 for Wan2.1's 480p).
        num_frames: Frames per video; the causal VAE needs ``num_frames = 1 (mod 4)`` (81 is WanPipeline's default;
            1 is a single image).
        guidance_scale: Classifier-free guidance scale; ``> 1`` turns CFG on (doubling the transformer batch).
            5.0 is WanPipeline's default and DanceGRPO's Wan2.1 ``--cfg_infer``.
        negative_prompt: Prompt of the unconditional branch; ``""`` as WanPipeline's ``encode_prompt`` and
            DanceGRPO's Wan2.1 embeddings use.
        lora: Train a LoRA adapter on the transformer with these settings; ``null`` for none. ``LoraSpec``'s default
            targets reach Wan's self- and cross-attention projections (``attn1``/``attn2`` ``to_q/k/v/out.0``).
        full_finetune: Train every transformer parameter instead of a LoRA adapter.
        gradient_checkpointing: Recompute transformer activations in the backward pass to save memory.
        reference: Keep a frozen reference model for KL terms. LoRA always has one for free (adapter disabled);
            full fine-tuning needs this flag and keeps a frozen copy of the transformer.
        max_sequence_length: UMT5 tokens per prompt, zero-padded (WanPipeline's default 512).
        local_files_only: Never contact the hub; hub ids must already be in the local cache.
        time_grid: ``"diffusers"`` (default): the pipeline scheduler's own sigmas (:func:`wan_diffusers_sigmas`; for
            the released UniPC scheduler its flow-shifted grid). ``"shifted-linspace"``:
            ``time_shift(linspace(1, 0, T+1), shift)``, DanceGRPO's Wan2.1 grid. See ``docs/models.md`` "Time grids".
        shift: Time shift; ``null`` takes the scheduler config's (``flow_shift`` / ``shift``: 3.0 for Wan2.1 480p,
            DanceGRPO's ``--shift 3``). With ``"diffusers"`` it replaces the scheduler's shift (WanPipeline's docs use
            5.0 for 720p).
    """

    name: ClassVar[str] = "wan"
    media: ClassVar[str] = "video"
    pipeline_class: ClassVar[str] = "WanPipeline"
    required_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
    weighted_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "text_encoder")

    def __init__(
        self,
        pretrained: str,
        dtype: DTypeName = "auto",
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        guidance_scale: Annotated[float, Range()] = 5.0,
        negative_prompt: str = "",
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
            # The base's square `resolution` is SD3/FLUX's; Wan checks height and width itself (validate, setup).
            resolution=height,
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
        self.height = int(height)
        self.width = int(width)
        self.num_frames = int(num_frames)
        self.negative_prompt = negative_prompt
        self._geometry = WanGeometry()
        self._sigmas: dict[int, Tensor] = {}

    # ------------------------------------------------------------------------------------------------ set-up

    @property
    def do_cfg(self) -> bool:
        """Whether classifier-free guidance is on (``guidance_scale > 1``, the pipeline's rule)."""
        return self.guidance_scale > 1.0

    def _configs(self) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]] | None:
        """``(vae, transformer, scheduler)`` configs readable without loading weights; ``None`` when none are (a hub
        id ``setup`` may download). Raises what :meth:`_pretrained_dir` raises."""
        if self._pipe is not None:
            pipe = self._pipe
            return pipe.vae.config, pipe.transformer.config, pipe.scheduler.config
        if parse_tiny_id(self.pretrained) is not None:
            return TINY_WAN_VAE, TINY_WAN_TRANSFORMER, {"_class_name": EULER_SCHEDULER}
        directory = self._pretrained_dir()
        if directory is None:
            return None
        return (
            read_config(directory, "vae"),
            read_config(directory, "transformer"),
            read_config(directory, "scheduler", "scheduler_config.json"),
        )

    def clean_tail_steps(self) -> int | None:
        """Final steps of the grid that land on a (near-)clean level, from the settings and the model's scheduler
        config: ``"shifted-linspace"`` and UniPC's flow grid end ``shift(≈1/T) -> 0`` (1); a flow-match Euler
        scheduler's grid ends ``... -> σ_min -> 0`` (2); ``None`` when the scheduler is not known before loading."""
        if self.time_grid == "shifted-linspace":
            return 1
        if self.time_grid != "diffusers":
            return None  # validate reports the unknown name
        try:
            configs = self._configs()
        except (ValueError, ModelDirError):
            return None
        name = None if configs is None else configs[2].get("_class_name")
        return {EULER_SCHEDULER: 2, UNIPC_SCHEDULER: 1}.get(str(name))

    def validate(self, recipe: Any) -> list[str]:
        """Check the settings, the model directory (local, or a hub id's snapshot in the local cache), that the
        video size fits the VAE, patch and RoPE, and that the scheduler gives a ``"diffusers"`` grid, all without
        loading weights."""
        problems = self._setting_problems()
        try:
            configs = self._configs()
            geometry = WanGeometry() if configs is None else WanGeometry.from_configs(configs[0], configs[1])
        except (ValueError, TypeError, ModelDirError) as e:  # TypeError/ValueError: a config value of the wrong kind
            return [*problems, f"model.init_args.pretrained: {e}"]
        # configs None: a hub id setup() may download, checked against Wan2.1's own geometry
        problems += geometry.problems(self.height, self.width, self.num_frames)
        if configs is None:
            return problems
        scheduler = configs[2]
        if self.time_grid == "diffusers" and scheduler:
            try:
                wan_diffusers_sigmas(2, scheduler, self.shift)
            except ValueError as e:
                problems.append(f"model.init_args.time_grid: {e}; use time_grid 'shifted-linspace'")
        return problems

    def setup(self, device: torch.device) -> None:
        """Load the pipeline, move it to ``device`` in the weight dtype and prepare LoRA / full FT / reference.

        Raises:
            ModelDirError: The local directory is missing or malformed (the message names what is missing).
            OSError: diffusers could not load the model (wrapped with the path or hub id).
            ValueError: A two-expert or timestep-expanding (Wan2.2) pipeline, a video size the model cannot take,
                or a scheduler without a ``"diffusers"`` grid.
        """
        pipe = self._load_pipeline(device)
        if pipe.transformer is None or getattr(pipe, "transformer_2", None) is not None:
            raise ValueError(f"{self.pretrained!r}: two-expert (Wan2.2 A14B) pipelines are not supported")
        if pipe.config.get("expand_timesteps", False):
            raise ValueError(f"{self.pretrained!r}: per-token timesteps (Wan2.2 TI2V) are not supported")
        geometry = WanGeometry(
            temporal=int(pipe.vae_scale_factor_temporal),
            spatial=int(pipe.vae_scale_factor_spatial),
            patch=tuple(int(p) for p in pipe.transformer.config.patch_size),  # type: ignore[arg-type]
            rope_max_seq_len=int(pipe.transformer.config.rope_max_seq_len),
        )
        problems = geometry.problems(self.height, self.width, self.num_frames)
        if problems:
            raise ValueError("; ".join(problems))
        if self.time_grid == "diffusers":
            wan_diffusers_sigmas(2, pipe.scheduler.config, self.shift)  # refuse an unsupported scheduler now
        self._geometry = geometry
        self._prepare(pipe, 1, "height, width and num_frames are checked above")
        self._sigmas.clear()

    def _build_tiny(self, seed: int) -> Path:
        return ensure_tiny_wan(seed)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:  # type: ignore[override]  # the base's is image-shaped
        """``(C, F_lat, H/8, W/8)`` of one video latent, ``F_lat = (F - 1)/4 + 1`` (``WanPipeline.prepare_latents``)."""
        g = self._geometry
        channels = int(self.transformer.config.in_channels)
        return (channels, g.latent_frames(self.num_frames), self.height // g.spatial, self.width // g.spatial)

    @property
    def frames(self) -> int:
        """Decoded frames per sample, ``1 + 4·(F_lat - 1)``: ``num_frames`` (validated ``= 1 mod 4``)."""
        return 1 + self._geometry.temporal * (self._geometry.latent_frames(self.num_frames) - 1)

    # ------------------------------------------------------------------------------------------------ policy

    def sigmas(self, num_steps: int) -> Tensor:
        """``"diffusers"``: the pipeline scheduler's sigmas (:func:`wan_diffusers_sigmas`, ``shift`` replacing the
        scheduler's when set); ``"shifted-linspace"``: DanceGRPO's grid with ``shift`` (else the config's
        ``flow_shift`` / ``shift``)."""
        cfg = self.pipe.scheduler.config
        if self.time_grid == "diffusers":
            if num_steps not in self._sigmas:  # a scheduler per call is cheap, but samplers ask every rollout
                self._sigmas[num_steps] = wan_diffusers_sigmas(num_steps, cfg, self.shift)
            return self._sigmas[num_steps].to(self.device, copy=True)
        shift = self.shift if self.shift is not None else float(cfg.get("flow_shift") or cfg.get("shift") or 1.0)
        return shifted_linspace_sigmas(num_steps, shift).to(self.device)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts with the pipeline's ``encode_prompt`` (UMT5, zero-padded to ``max_sequence_length``),
        cached per prompt string.

        ``Conditioning.tensors`` holds ``prompt_embeds`` ``[B, L, D]``, plus ``negative_prompt_embeds`` (the negative
        prompt's, one row per prompt) when CFG is on.
        """
        return Conditioning(self._cache.get(list(prompts), self._encode_batch))

    @torch.no_grad()
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, npe = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=[self.negative_prompt] * len(prompts) if self.do_cfg else None,
            do_classifier_free_guidance=self.do_cfg,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        out = {"prompt_embeds": pe}
        if self.do_cfg:
            out["negative_prompt_embeds"] = npe
        return out

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None = None) -> Tensor:
        """Velocity at ``(latents, σ)`` with CFG ``v_u + g·(v_c - v_u)`` (the pipeline's formula), in fp32.

        The transformer gets ``timestep = 1000·σ`` in fp32, what ``WanPipeline.__call__`` passes from a flow-match
        Euler scheduler. With CFG the conditional and unconditional rows run in one batch ``[cond; uncond]``
        (DanceGRPO's ``train_grpo_wan_2_1.py``; the pipeline makes two calls, which differ only by float rounding:
        the prompt embeddings are zero-padded to one length and the transformer takes no attention mask).

        Args:
            latents: ``[B, C, F_lat, h, w]`` states.
            sigma: ``[B]`` noise levels.
            cond: ``B`` rows of conditioning from :meth:`encode` (``Conditioning.select``).
            guidance: ``None``: ``guidance_scale``; ``1.0``: the conditional rows alone (one pass over ``B`` rows);
                ``g > 1``: CFG at ``g`` (needs ``guidance_scale > 1``, so that ``encode`` computed the negative rows).

        Raises:
            ValueError: Latents that are not 5-D, or a ``guidance`` below 1, not finite, or above 1 when
                ``guidance_scale`` is not.
        """
        if latents.ndim != 5:
            raise ValueError(f"velocity: Wan latents are [B, C, F, h, w], got shape {tuple(latents.shape)}")
        b = latents.shape[0]
        t = cond.tensors
        if t["prompt_embeds"].shape[0] != b:
            raise ValueError(f"velocity: {b} latents but {t['prompt_embeds'].shape[0]} conditioning rows")
        scale = self._cfg_scale(guidance)
        sigma = sigma.to(self.device, torch.float32).reshape(-1).expand(b)
        x = latents.to(self.device, self._dtype)
        timestep = timesteps_from_sigmas(sigma)
        enc = t["prompt_embeds"]
        if scale > 1.0:
            x = torch.cat([x, x])
            timestep = torch.cat([timestep, timestep])
            enc = torch.cat([enc, t["negative_prompt_embeds"]])
        out: Tensor = self._active_transformer()(
            hidden_states=x, timestep=timestep, encoder_hidden_states=enc.to(self._dtype), return_dict=False
        )[0]
        self.forward_count += b
        if scale > 1.0:
            text, uncond = out.float().chunk(2)
            out = uncond + scale * (text - uncond)
        return out.float()

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """VAE-decode clean ``[B, C, F_lat, h, w]`` latents to ``[B, F, H, W, 3]`` uint8 frames on the device.

        As ``WanPipeline.__call__``: ``x / (1/latents_std) + latents_mean`` per channel (the same two roundings), the
        VAE decoder (which clamps to ``[-1, 1]``), then ``VideoProcessor.postprocess_video``'s ``x·½ + ½`` clamped to
        ``[0, 1]`` and ``round(255·x)`` as its PIL output rounds (``diffusers.utils.export_to_video`` truncates
        instead, which can be one level lower).
        """
        if latents.ndim != 5:
            raise ValueError(f"decode: Wan latents are [B, C, F, h, w], got shape {tuple(latents.shape)}")
        vae = self.pipe.vae
        x = latents.to(self.device, torch.float32)
        per_channel = (1, int(vae.config.z_dim), 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=self.device).view(per_channel)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=torch.float32, device=self.device).view(per_channel)
        video: Tensor = vae.decode((x / inv_std + mean).to(vae.dtype), return_dict=False)[0].float()
        video = (video * 0.5 + 0.5).clamp(0, 1)
        return (video * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).contiguous()


@hookimpl
def rlpost_register_models(register: Registry[Policy]) -> None:
    """Register :class:`WanPolicy` (short name ``wan``)."""
    register(WanPolicy)
