"""Multi-process training with DeepSpeed ZeRO: the :class:`DeepSpeedBackend`.

Its parts: the recipe's ``distributed`` section and its checks (:mod:`rlpost.engine.distributed_config`), the
process group (:mod:`rlpost.engine.world`) and the ZeRO-partitioned state seen whole (:mod:`rlpost.engine.zero_state`);
the names the recipe and the runner use are importable from here too. These are the only modules that import
``deepspeed`` (lazily, inside functions: ``rlpost validate`` and single-process runs never pay for the import). How
work is split across ranks (prompt groups, RNG streams, gathered advantages) lives in :mod:`rlpost.engine.sharding`,
which knows nothing about DeepSpeed.

Gradient accounting. Update rules call :meth:`DeepSpeedBackend.backward` once per minibatch and
:meth:`DeepSpeedBackend.step` once per optimizer step, with each minibatch loss already divided by the number of
edges of *this rank's* optimizer step. DeepSpeed runs with ``gradient_accumulation_steps: 1`` (so it never rescales
a loss) and every backward adds into the gradient buffers until ``engine.step()``; ZeRO then **averages** gradients
over ranks. With ``W`` ranks each holding ``E_r`` of the step's ``E`` trainable edges, the average is the
single-process mean over ``E`` edges exactly when each loss is multiplied by ``W·E_r/E`` (the ``loss_weight``,
1.0 whenever ranks hold equal numbers of trainable edges, which is the normal case).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from rlpost.engine.backend import EngineBackend
from rlpost.engine.checkpoint import CheckpointError
from rlpost.engine.distributed_config import (
    FORBIDDEN_DS_KEYS,
    DistributedConfig,
    env_world_size,
    read_ds_config,
    validate_distributed,
)
from rlpost.engine.ema import ReplicatedWeights, WeightShards
from rlpost.engine.world import World, init_world
from rlpost.engine.zero_state import (
    ConsolidatedOptimizerState,
    FragmentShards,
    Zero3Shards,
    is_zero_param,
    write_zero3_partitions,
)

__all__ = [
    "FORBIDDEN_DS_KEYS",
    "DeepSpeedBackend",
    "DistributedConfig",
    "World",
    "deepspeed_config",
    "env_world_size",
    "init_world",
    "validate_distributed",
]


def use_bf16(cfg: DistributedConfig, device: torch.device) -> bool:
    """Resolve ``bf16: auto``: on for CUDA devices that support it, off on CPU."""
    if cfg.bf16 == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return bool(cfg.bf16)


def deepspeed_config(
    cfg: DistributedConfig, world_size: int, max_grad_norm: float | None, bf16: bool
) -> dict[str, Any]:
    """The DeepSpeed config handed to ``deepspeed.initialize``: the user's file (if any) under our settings.

    One "micro batch" per optimizer step and ``gradient_accumulation_steps: 1``: DeepSpeed never rescales a loss;
    the update rule's minibatches accumulate into the gradient buffers until :meth:`DeepSpeedBackend.step`.
    """
    base: dict[str, Any] = {}
    if cfg.deepspeed_config is not None:
        data, error = read_ds_config(cfg.deepspeed_config)
        if error is not None or data is None:
            raise ValueError(f"distributed.deepspeed_config: {error}")
        base = data
    zero = dict(base.get("zero_optimization") or {})
    zero["stage"] = cfg.zero_stage
    base.update(
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "train_batch_size": world_size,
            "zero_optimization": zero,
            "gradient_clipping": float(max_grad_norm) if max_grad_norm is not None else 0.0,
            "bf16": {**(base.get("bf16") or {}), "enabled": bf16},
            # A torch optimizer from the recipe is "untested" in DeepSpeed's terms; ZeRO shards it all the same.
            "zero_allow_untested_optimizer": True,
            "steps_per_print": base.get("steps_per_print", 2**31 - 1),
            "wall_clock_breakdown": base.get("wall_clock_breakdown", False),
        }
    )
    return base


class _ParameterHolder(nn.Module):
    """Wraps a bare list of trainable parameters for policies that expose no module (ZeRO 0-2 only)."""

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(parameters)


class DeepSpeedBackend(EngineBackend):
    """DeepSpeed ZeRO behind the :class:`~rlpost.core.api.TrainBackend` interface.

    Args:
        module: The module holding the trainable parameters (the policy's denoiser); frozen modules (text encoders,
            VAE, reward models) are never handed to DeepSpeed.
        parameters: The trainable parameters, in ``Policy.trainable_parameters()`` order.
        optimizer: The torch optimizer built from the recipe's ``torch_optimizer``.
        scheduler: The LR scheduler from ``lr_scheduler`` (stepped by DeepSpeed after every optimizer step).
        max_grad_norm: Gradient-norm clip (DeepSpeed's ``gradient_clipping``); ``None`` disables it.
        cfg: The recipe's ``distributed`` section.
        world: This rank's place in the world.
    """

    def __init__(
        self,
        module: nn.Module | None,
        parameters: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        max_grad_norm: float | None,
        cfg: DistributedConfig,
        world: World,
    ) -> None:
        import deepspeed

        if not parameters:
            raise ValueError("DeepSpeedBackend: the policy exposes no trainable parameters")
        if module is None:
            if cfg.zero_stage == 3:
                raise ValueError("distributed.zero_stage 3 needs a policy exposing its denoiser module")
            module = _ParameterHolder(parameters)
        self.parameters = parameters
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.world = world
        self.bf16 = use_bf16(cfg, world.device)
        config = deepspeed_config(cfg, world.world_size, max_grad_norm, self.bf16)
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=config, dist_init_required=False
        )
        self.engine = engine
        self.optimizer = ConsolidatedOptimizerState(engine, optimizer, parameters)
        self.loss_weight = 1.0
        self._pending: Tensor | None = None
        self.num_steps = 0
        self.skipped_steps = 0

    @property
    def world_size(self) -> int:
        """Number of ranks sharing the update."""
        return self.world.world_size

    def backward(self, loss: Tensor) -> None:
        """Accumulate gradients of ``loss`` (times :attr:`loss_weight`, see the module docstring); a non-finite one is
        refused and counted (:meth:`~rlpost.engine.backend.EngineBackend.refuse_nonfinite`).

        DeepSpeed must know at backward time whether a backward closes the optimizer step (ZeRO-2 reduces and
        partitions gradients inside backward at the boundary; earlier backwards only accumulate), but the update
        rule only says so afterwards, by calling :meth:`step`. So each backward runs one call late: the previous
        loss goes backward (not a boundary) when the next one arrives, and the last one in :meth:`step` with the
        boundary set. Exact for every ZeRO stage; the price is one extra minibatch graph alive while the next
        minibatch's forward runs.
        """
        if self.refuse_nonfinite(loss):
            return
        weighted = loss * self.loss_weight if self.loss_weight != 1.0 else loss
        if self._pending is not None:
            self._run_backward(self._pending, boundary=False)
        self._pending = weighted

    def _run_backward(self, loss: Tensor, boundary: bool) -> None:
        # The policy calls its module directly, not ``engine(...)``, so do what engine.forward does first: ZeRO-3
        # counts micro-steps there and otherwise overwrites (instead of accumulating) earlier gradients.
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if callable(clear):
            clear()
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss)

    def step(self) -> dict[str, float]:
        """Reduce, clip, step the optimizer and scheduler, zero gradients (``engine.step()``)."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self._pending is None:
            # Every minibatch of this step was skipped (non-finite loss): nothing to reduce, weights unchanged.
            return {"train/grad_norm": 0.0, "train/lr": lr}
        self._run_backward(self._pending, boundary=True)
        self._pending = None
        self.engine.step()
        raw = self.engine.get_global_grad_norm()
        norm = float(raw) if raw is not None else math.nan
        metrics = {"train/grad_norm": norm, "train/lr": lr}
        if raw is not None and not math.isfinite(norm):
            # DeepSpeed skips non-finite steps itself only with fp16 loss scaling; count it so the guards react.
            self.skipped_steps += 1
            return metrics
        self.num_steps += 1
        return metrics

    def weight_shards(self) -> WeightShards:
        """This rank's share of the trainable weights, for the EMA (:mod:`rlpost.engine.ema`): its slice of the fp32
        master weights under ZeRO 1-3 (and DeepSpeed's bf16 optimizer), the full parameters otherwise."""
        if any(hasattr(p, "ds_id") for p in self.parameters):
            return Zero3Shards(self.parameters, self.world.device)
        if any(hasattr(p, "_hp_mapping") for p in self.parameters):
            return FragmentShards(self.parameters)
        return ReplicatedWeights(self.parameters)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """The trainable parameters whole in the module on every rank, for saving them from the module (diffusers
        artefacts); a collective call. ZeRO-3 keeps only small (persistent) parameters whole; the others are
        gathered here (``deepspeed.zero.GatheredParameters``) and released on exit. A no-op below ZeRO-3."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        partitioned = [
            p
            for p in self.parameters
            if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
        ]
        if not partitioned:
            yield
            return
        from deepspeed.zero import GatheredParameters

        with GatheredParameters(partitioned, modifier_rank=None):
            yield

    # -------------------------------------------------------------------------------------- checkpoints

    def full_state_dict(self) -> dict[str, Tensor]:
        """fp32 trainable weights keyed ``trainable.NNNN`` (gathered under ZeRO-3); a collective call."""
        from deepspeed.utils import safe_get_full_fp32_param

        out: dict[str, Tensor] = {}
        for i, p in enumerate(self.parameters):
            full = safe_get_full_fp32_param(p) if is_zero_param(p) else None
            value = full if full is not None else p.detach()
            out[f"trainable.{i:04d}"] = value.detach().float().cpu().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, weights: dict[str, Tensor]) -> None:
        """Copy consolidated weights into the live parameters and ZeRO's fp32 master partitions; a collective call
        under ZeRO-3."""
        from deepspeed.utils import safe_set_full_fp32_param

        if len(weights) != len(self.parameters):
            raise CheckpointError(
                f"the checkpoint holds {len(weights)} trainable tensors but the policy has {len(self.parameters)}"
            )
        zero3 = [p for p in self.parameters if hasattr(p, "ds_id")]
        for i, p in enumerate(self.parameters):
            value = weights[f"trainable.{i:04d}"].to(torch.float32)
            if hasattr(p, "ds_id"):
                if value.numel() != p.ds_numel:  # type: ignore[attr-defined]
                    raise CheckpointError(
                        f"trainable parameter {i}: checkpoint shape {tuple(value.shape)} != {tuple(p.ds_shape)}"  # type: ignore[attr-defined]
                    )
                safe_set_full_fp32_param(p, value.to(self.world.device))
                continue
            if tuple(value.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"trainable parameter {i}: checkpoint shape {tuple(value.shape)} != {tuple(p.shape)}"
                )
            p.copy_(value.to(p.device, p.dtype))
            if is_zero_param(p):
                safe_set_full_fp32_param(p, value.to(self.world.device))
        if zero3:
            # The fp32 master partitions alone would reach the module only after the next optimizer step (ZeRO-3
            # copies master -> module partitions in step()): copy them now, as step() does.
            write_zero3_partitions(zero3, Zero3Shards(zero3, self.world.device).local())


def policy_module(policy: object) -> nn.Module | None:
    """The module DeepSpeed wraps: the policy's denoiser (``transformer``) when it exposes one."""
    module = getattr(policy, "transformer", None)
    return module if isinstance(module, nn.Module) else None


GatherFn = Callable[[Any], list[Any]]
