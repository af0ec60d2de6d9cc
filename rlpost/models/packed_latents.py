"""The base of adapters whose transformer takes 2x2-packed latent tokens on a dynamic-shift grid (FLUX.1, Qwen-Image).

``FluxPipeline`` and ``QwenImagePipeline`` (diffusers 0.42.1 ``pipelines/flux/pipeline_flux.py``,
``pipelines/qwenimage/pipeline_qwenimage.py``) share the latent layout and the time grid: image-shaped latents
``[B, C, H/f, W/f]`` packed into ``[B, (H/2f)(W/2f), 4C]`` tokens (``_pack_latents``), a resolution a multiple of
2 x the VAE factor, the timestep ``(1000·σ)/1000`` in the weight dtype, and sigmas ``linspace(1, 1/T, T)`` handed to
the pipeline's scheduler with ``mu`` linear in the number of image tokens (``calculate_shift``). This module holds
that part once: the packing and grid functions and :class:`PackedLatentPolicy`, which FLUX.1
(``rlpost/models/flux.py``) and Qwen-Image (``plugins/rlpost_qwenimage/policy.py``) subclass; each writes its own
prompt encoding, transformer call (with its guidance) and, for Qwen-Image, decoding.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from rlpost.core.api import Conditioning
from rlpost.models._common import DiffusersTransformerPolicy
from rlpost.models.tiny import parse_tiny_id
from rlpost.ops.schedules import shifted_linspace_sigmas, timesteps_from_sigmas

__all__ = ["PackedLatentPolicy", "flux_mu", "flux_sigmas", "pack_latents", "unpack_latents"]


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


class PackedLatentPolicy(DiffusersTransformerPolicy):
    """A :class:`DiffusersTransformerPolicy` whose transformer takes 2x2-packed latent tokens and whose
    ``"diffusers"`` grid is the pipeline's dynamically shifted one (``mu`` from the image sequence length).

    Gives ``validate`` (settings, model directory, resolution against 2 x the VAE factor), ``setup``, the unpacked
    ``latent_shape``, ``image_seq_len``, ``mu``, ``sigmas`` and :meth:`_packed_inputs` (the tokens and timestep of a
    ``velocity`` call). Subclasses set :attr:`family` and :attr:`tiny_vae_factor`, implement :meth:`_vae_factor_of`
    and write ``encode``, ``velocity`` and ``clean_tail_steps`` (and extend ``setup`` for their own state). The
    constructor arguments are :class:`DiffusersTransformerPolicy`'s, documented on each subclass.
    """

    family: ClassVar[str] = ""
    """The model family as error messages name it (``"FLUX"``, ``"Qwen-Image"``)."""
    tiny_vae_factor: ClassVar[int] = 0
    """VAE factor of the family's ``tiny-random`` build (checked by ``validate`` before it is built)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sigmas: dict[int, Tensor] = {}  # the "diffusers" grid per step count (a scheduler per call)

    # ------------------------------------------------------------------------------------------------ set-up

    @abstractmethod
    def _vae_factor_of(self, directory: Path) -> int:
        """The VAE's spatial factor, read from a pipeline directory's configs without loading weights.

        Raises:
            ValueError or OSError: The config is missing or malformed (the message names the file).
        """

    def validate(self, recipe: Any) -> list[str]:
        """Check the settings, the model directory (local, or a hub id's snapshot in the local cache: its pipeline
        class, components and configs) and that the resolution fits the VAE factor (read from its config) and the
        2x2 packing, without loading weights."""
        problems = self._setting_problems()
        if self.shift is not None and self.time_grid == "diffusers":
            problems.append(
                f"model.init_args.shift: the 'diffusers' {self.family} grid shifts by e^mu from the resolution; set "
                "shift only with time_grid 'shifted-linspace' (or leave it null)"
            )
        try:
            directory = self._pretrained_dir()
            if directory is not None:
                vae_factor: int | None = self._vae_factor_of(directory)
            elif parse_tiny_id(self.pretrained) is not None:
                vae_factor = self.tiny_vae_factor  # built on first use from known configs
            else:
                vae_factor = None  # a hub id setup() may download: nothing local to read
        except (ValueError, OSError) as e:  # a malformed tiny id; ModelDirError (an OSError) naming what is missing
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
        self._sigmas.clear()

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H/f, W/f)`` of one *unpacked* latent (``C`` = transformer input channels / 4)."""
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
        """The resolution-dependent shift parameter of the ``"diffusers"`` grid (:func:`flux_mu`; QwenImagePipeline
        calls the same ``calculate_shift`` as FluxPipeline, with its scheduler config's bounds)."""
        return flux_mu(self.image_seq_len, self.pipe.scheduler.config)

    # ------------------------------------------------------------------------------------------------ policy

    def sigmas(self, num_steps: int) -> Tensor:
        """``"diffusers"``: exactly the pipeline's sigmas at this resolution (its scheduler given
        ``linspace(1, 1/T, T)`` and :attr:`mu`, :func:`flux_sigmas`); ``"shifted-linspace"``: DanceGRPO's/MixGRPO's
        static grid with ``shift`` (else the scheduler config's)."""
        cfg = self.pipe.scheduler.config
        if self.time_grid == "diffusers":
            if num_steps not in self._sigmas:  # a scheduler per call is cheap, but samplers ask every rollout
                self._sigmas[num_steps] = flux_sigmas(num_steps, self.mu, cfg)
            return self._sigmas[num_steps].to(self.device, copy=True)
        shift = float(cfg.shift) if self.shift is None else self.shift
        return shifted_linspace_sigmas(num_steps, shift).to(self.device)

    def _packed_inputs(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> tuple[Tensor, Tensor]:
        """The ``[B, (h/2)(w/2), 4C]`` tokens (weight dtype) and ``[B]`` timesteps of a ``velocity`` call: both
        pipelines take ``t = 1000·σ`` (fp32), cast it to the latents' dtype and divide by 1000.

        Raises:
            ValueError: ``cond`` has another number of rows than ``latents``.
        """
        b = latents.shape[0]
        rows = cond.tensors["prompt_embeds"].shape[0]
        if rows != b:
            raise ValueError(f"velocity: {b} latents but {rows} conditioning rows")
        sigma = sigma.to(self.device, torch.float32).reshape(-1).expand(b)
        tokens = pack_latents(latents.to(self.device, self._dtype))
        return tokens, timesteps_from_sigmas(sigma).to(self._dtype) / 1000
