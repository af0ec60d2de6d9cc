"""The recipe's ``distributed`` section (:class:`DistributedConfig`) and its checks, also against the rest of the recipe
and the launch (:func:`validate_distributed`).

Reading the section imports nothing of DeepSpeed: ``rlpost validate`` and single-process runs never pay for it. The
backend that uses the section is :mod:`rlpost.engine.distributed`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlpost.core.user_files import UserFileError, read_json_file

__all__ = ["FORBIDDEN_DS_KEYS", "DistributedConfig", "env_world_size", "read_ds_config", "validate_distributed"]

# The optimizer and LR scheduler are defined once, in the recipe (torch_optimizer / lr_scheduler): a DeepSpeed
# config defining them too would silently win or conflict, so validation rejects it.
FORBIDDEN_DS_KEYS = ("optimizer", "scheduler")


@dataclass
class DistributedConfig:
    """The recipe's optional ``distributed`` section; absent = one process with the plain torch backend.

    Attributes:
        backend: Process-group backend: ``auto`` (NCCL on CUDA, gloo on CPU), ``nccl`` or ``gloo``.
        zero_stage: DeepSpeed ZeRO stage 0 (plain data parallel), 1 (optimizer state sharded), 2 (plus gradients;
            the default) or 3 (plus parameters).
        deepspeed_config: Optional DeepSpeed JSON config merged under ours (communication buckets, offload ...);
            it must not define ``optimizer`` or ``scheduler`` blocks.
        bf16: bf16 mixed precision: ``auto`` (on when CUDA supports bf16), ``true`` or ``false``.
    """

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    zero_stage: int = 2
    deepspeed_config: str | None = None
    bf16: Literal["auto"] | bool = "auto"

    def problems(self) -> list[str]:
        """Range problems and problems of the DeepSpeed JSON file, each naming its field relative to the section (the
        recipe prefixes ``distributed.``; checks against other sections: :func:`validate_distributed`)."""
        problems: list[str] = []
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"zero_stage: must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.deepspeed_config is None:
            return problems
        path = self.deepspeed_config
        data, error = read_ds_config(path)
        if error is not None or data is None:
            return [*problems, f"deepspeed_config: {error}"]
        for key in FORBIDDEN_DS_KEYS:
            if key in data:
                problems.append(
                    f"deepspeed_config: {path} defines a {key!r} block; the optimizer and LR scheduler are defined "
                    "once in the recipe (torch_optimizer, lr_scheduler): remove it"
                )
        stage = (data.get("zero_optimization") or {}).get("stage")
        if stage is not None and stage != self.zero_stage:
            problems.append(
                f"deepspeed_config: zero_optimization.stage {stage} in {path} contradicts distributed.zero_stage "
                f"{self.zero_stage}"
            )
        gas = data.get("gradient_accumulation_steps")
        if gas not in (None, 1, "auto"):
            problems.append(
                "deepspeed_config: gradient_accumulation_steps must be 1 or absent (the update rule accumulates "
                f"minibatches itself), got {gas!r}"
            )
        return problems


def env_world_size() -> int:
    """``WORLD_SIZE`` set by ``torchrun`` / the ``deepspeed`` launcher, 1 when started plainly."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


MAX_DS_CONFIG_BYTES = 1024 * 1024
"""A DeepSpeed config is a few hundred bytes of JSON."""


def read_ds_config(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """The user's DeepSpeed JSON config, or ``(None, problem)``: read with
    :func:`rlpost.core.user_files.read_json_file` (missing, not UTF-8, over :data:`MAX_DS_CONFIG_BYTES`, invalid or
    too deeply nested JSON, a repeated key)."""
    if not Path(path).is_file():
        return None, f"file not found: {path}"
    try:
        data = read_json_file(path, "DeepSpeed config", MAX_DS_CONFIG_BYTES)
    except UserFileError as exc:
        return None, str(exc)
    if not isinstance(data, dict):
        return None, f"{path} must hold a JSON object"
    return data, None


def validate_distributed(
    cfg: DistributedConfig, groups_per_step: int, world_size: int | None = None, ema: bool = False
) -> list[str]:
    """Checks of the ``distributed`` section against the rest of the recipe and the launch (the section's own checks
    are :meth:`DistributedConfig.problems`); every problem names its field.

    Args:
        cfg: The section.
        groups_per_step: ``run.groups_per_step`` (split across ranks, so it must divide by the world size).
        world_size: Number of ranks; default ``WORLD_SIZE`` from the launcher's environment.
        ema: Whether the recipe enables ``ema``.
    """
    problems: list[str] = []
    data = read_ds_config(cfg.deepspeed_config)[0] if cfg.deepspeed_config is not None else None
    offload = (((data or {}).get("zero_optimization") or {}).get("offload_param") or {}).get("device")
    if ema and cfg.zero_stage == 3 and offload == "nvme":
        # The EMA is swapped into each rank's parameter partitions, which NVMe offload keeps on disk.
        problems.append(
            f"distributed.deepspeed_config: zero_optimization.offload_param.device 'nvme' in "
            f"{cfg.deepspeed_config} cannot be combined with ema (use offload to 'cpu' or drop the ema section)"
        )
    world = env_world_size() if world_size is None else world_size
    if world > 0 and groups_per_step % world:
        problems.append(
            f"run.groups_per_step: {groups_per_step} prompt groups do not divide across {world} ranks (WORLD_SIZE); "
            "each rank samples whole groups"
        )
    return problems
