"""Wan2.1's geometry and time grid: what video sizes a Wan model accepts (VAE compression, 3-D patch, RoPE table)
and the sigmas its own scheduler steps through (:func:`wan_diffusers_sigmas`), read from its configs without weights.

Used by :mod:`rlpost.models.wan` (the adapter) before and after loading; followed at diffusers 0.42.1
(``pipelines/wan/pipeline_wan.py``, ``schedulers/scheduling_flow_match_euler_discrete.py``,
``schedulers/scheduling_unipc_multistep.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlpost.models.tiny_wan import TINY_WAN_TRANSFORMER, TINY_WAN_VAE

__all__ = ["EULER_SCHEDULER", "TINY_WAN_GEOMETRY", "UNIPC_SCHEDULER", "WanGeometry", "wan_diffusers_sigmas"]

EULER_SCHEDULER = "FlowMatchEulerDiscreteScheduler"
UNIPC_SCHEDULER = "UniPCMultistepScheduler"


@dataclass(frozen=True)
class WanGeometry:
    """What a Wan model accepts as a video size: VAE compression, 3-D patch and RoPE table length.

    Attributes:
        temporal: VAE temporal factor (Wan2.1: 4): ``F`` frames become ``(F - 1)/4 + 1`` latent frames.
        spatial: VAE spatial factor (Wan2.1: 8).
        patch: The transformer's ``(p_t, p_h, p_w)`` patch (Wan2.1: ``(1, 2, 2)``).
        rope_max_seq_len: RoPE table length per axis (Wan2.1: 1024): at most that many patches per axis.
    """

    temporal: int = 4
    spatial: int = 8
    patch: tuple[int, int, int] = (1, 2, 2)
    rope_max_seq_len: int = 1024

    @classmethod
    def from_configs(cls, vae: Mapping[str, Any], transformer: Mapping[str, Any]) -> WanGeometry:
        """From ``vae/config.json`` and ``transformer/config.json`` contents (missing keys: Wan2.1's values, the
        classes' defaults)."""
        default = cls()
        p_t, p_h, p_w = (int(p) for p in transformer.get("patch_size") or default.patch)
        return cls(
            temporal=int(vae.get("scale_factor_temporal") or default.temporal),
            spatial=int(vae.get("scale_factor_spatial") or default.spatial),
            patch=(p_t, p_h, p_w),
            rope_max_seq_len=int(transformer.get("rope_max_seq_len") or default.rope_max_seq_len),
        )

    def latent_frames(self, num_frames: int) -> int:
        """Latent frames of a ``num_frames`` video (``WanPipeline.prepare_latents``)."""
        return (num_frames - 1) // self.temporal + 1

    def problems(self, height: int, width: int, num_frames: int) -> list[str]:
        """Why a ``num_frames`` x ``height`` x ``width`` video does not fit, each naming its recipe field.

        ``WanPipeline.__call__`` rounds such sizes down with a warning; a training run must not silently train on
        another size than the recipe says, so they are errors here.
        """
        out: list[str] = []
        field = "model.init_args."
        if num_frames < 1:
            out.append(f"{field}num_frames: must be >= 1, got {num_frames}")
        elif (num_frames - 1) % self.temporal:
            lower = (num_frames - 1) // self.temporal * self.temporal + 1
            out.append(
                f"{field}num_frames: {num_frames} frames do not fit the VAE's temporal factor {self.temporal}: "
                f"need num_frames = 1 (mod {self.temporal}), e.g. {lower} or {lower + self.temporal}"
            )
        elif self.latent_frames(num_frames) % self.patch[0]:
            out.append(f"{field}num_frames: {num_frames} frames give latent frames not divisible by {self.patch[0]}")
        elif self.latent_frames(num_frames) // self.patch[0] > self.rope_max_seq_len:
            out.append(f"{field}num_frames: {num_frames} frames exceed the RoPE table ({self.rope_max_seq_len})")
        for name, size, patch in (("height", height, self.patch[1]), ("width", width, self.patch[2])):
            factor = self.spatial * patch
            if size <= 0:
                out.append(f"{field}{name}: must be positive, got {size}")
            elif size % factor:
                out.append(
                    f"{field}{name}: {size} is not a multiple of {factor} "
                    f"(VAE factor {self.spatial} x patch size {patch})"
                )
            elif size // factor > self.rope_max_seq_len:
                out.append(
                    f"{field}{name}: {size} is too large for this model: at most {self.rope_max_seq_len * factor} "
                    f"(rope_max_seq_len {self.rope_max_seq_len} patches x {factor} pixels)"
                )
        return out


TINY_WAN_GEOMETRY = WanGeometry.from_configs(TINY_WAN_VAE, TINY_WAN_TRANSFORMER)


def wan_diffusers_sigmas(num_steps: int, scheduler_config: Mapping[str, Any], shift: float | None = None) -> Tensor:
    """``[num_steps + 1]`` fp32 noise levels of the pipeline's own scheduler for ``num_steps`` steps.

    A fresh scheduler of the config's class is built from the config (``shift`` replaces its ``shift`` /
    ``flow_shift`` when given) and ``set_timesteps(num_steps)`` is read back, so every option the model ships with is
    honoured:

    * ``FlowMatchEulerDiscreteScheduler`` (static shift): its ``sigmas`` exactly, the grid ``WanPipeline.__call__``
      steps through with it (SD3's ``"diffusers"`` grid, ending ``... -> σ_min -> 0``).
    * ``UniPCMultistepScheduler`` with ``use_flow_sigmas`` (what ``Wan-AI/Wan2.1-T2V-*-Diffusers`` ship,
      ``flow_shift`` 3.0 for 480p, 5.0 for 720p, ``final_sigmas_type="zero"``): its flow sigmas,
      ``flow_shift``-shifted ``linspace(1, 1/1000, T+1)[:-1]`` then 0, which ends ``... -> shift(≈1/T) -> 0``. The
      scheduler lowers the first level by 1e-6 only to keep its own ``log α`` finite; that nudge is undone (the first
      level is ``shift(1) = 1`` exactly). What differs from the pipeline is the *solver*: rlpost's kernels take
      single steps on this grid, UniPC is a second-order multistep predictor-corrector, so a UniPC model's Euler ODE
      samples are close to but not the pipeline's.

    Raises:
        ValueError: Another scheduler class, dynamic shifting, UniPC without flow sigmas, or a grid that does not run
            from 1 to 0 (e.g. ``final_sigmas_type="sigma_min"``).
    """
    import diffusers

    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    cfg = dict(scheduler_config)
    name = str(cfg.get("_class_name", ""))
    if name not in (EULER_SCHEDULER, UNIPC_SCHEDULER):
        raise ValueError(
            f"the 'diffusers' time grid supports {EULER_SCHEDULER} and {UNIPC_SCHEDULER} schedulers, not {name or '?'}"
        )
    if cfg.get("use_dynamic_shifting"):
        raise ValueError(f"{name} with use_dynamic_shifting (resolution-dependent shift) is not supported")
    if name == UNIPC_SCHEDULER and not cfg.get("use_flow_sigmas"):
        raise ValueError(f"{name} without use_flow_sigmas is not a flow-matching schedule")
    if shift is not None:
        cfg["shift" if name == EULER_SCHEDULER else "flow_shift"] = float(shift)
    scheduler: Any = getattr(diffusers, name).from_config(cfg)
    scheduler.set_timesteps(num_steps, device="cpu")
    sigmas: Tensor = scheduler.sigmas.to(torch.float32).clone()
    if name == UNIPC_SCHEDULER and abs(float(sigmas[0]) - 1.0) <= 1e-5:
        sigmas[0] = 1.0  # undo UniPC's log-alpha guard (1 - 1e-6, stored in fp32 as 1 - 1.01e-6; see above)
    if sigmas.shape != (num_steps + 1,) or float(sigmas[0]) != 1.0 or float(sigmas[-1]) != 0.0:
        raise ValueError(f"{name} gives a grid that does not run from 1 to 0 in {num_steps} steps: {sigmas.tolist()}")
    if not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError(f"{name} gives a grid that is not strictly decreasing: {sigmas.tolist()}")
    return sigmas
