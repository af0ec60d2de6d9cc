"""Multi-process training with DeepSpeed ZeRO: process-group start-up, the ``distributed`` recipe section and the
:class:`DeepSpeedBackend`.

This is the only module that imports ``deepspeed`` (lazily, inside functions: ``rlpost validate`` and single-process
runs never pay for the import). How work is split across ranks (prompt groups, RNG streams, gathered advantages)
lives in :mod:`rlpost.engine.sharding`, which knows nothing about DeepSpeed.

Gradient accounting. Update rules call :meth:`DeepSpeedBackend.backward` once per minibatch and
:meth:`DeepSpeedBackend.step` once per optimizer step, with each minibatch loss already divided by the number of
edges of *this rank's* optimizer step. DeepSpeed runs with ``gradient_accumulation_steps: 1`` (so it never rescales
a loss) and every backward adds into the gradient buffers until ``engine.step()``; ZeRO then **averages** gradients
over ranks. With ``W`` ranks each holding ``E_r`` of the step's ``E`` trainable edges, the average is the
single-process mean over ``E`` edges exactly when each loss is multiplied by ``W·E_r/E`` (the ``loss_weight``,
1.0 whenever ranks hold equal numbers of trainable edges, which is the normal case).
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from rlpost.engine.backend import EngineBackend
from rlpost.engine.checkpoint import CheckpointError
from rlpost.engine.ema import ReplicatedWeights, WeightShards, swapped_in

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
        data, error = _read_ds_config(path)
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


def _read_ds_config(path: str) -> tuple[dict[str, Any] | None, str | None]:
    p = Path(path)
    if not p.is_file():
        return None, f"file not found: {path}"
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        return None, f"{path} is not valid JSON: {exc}"
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
    data = _read_ds_config(cfg.deepspeed_config)[0] if cfg.deepspeed_config is not None else None
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


# ------------------------------------------------------------------------------------------------ process group


@dataclass(frozen=True)
class World:
    """This process's place among the ranks.

    Attributes:
        rank: Global rank (0 = main process: the only one that prints or writes).
        world_size: Number of ranks.
        local_rank: Rank on this node (selects the GPU).
        device: Device this rank trains on.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order; a collective call."""
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        """Wait for every rank (after rank 0 wrote shared files)."""
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_world(cfg: DistributedConfig, device_spec: str) -> World:
    """Start (once) the process group from the launcher's environment and pick this rank's device.

    ``torchrun`` and the ``deepspeed`` launcher both export ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
    and ``MASTER_PORT``; a plain ``rlpost train`` with a ``distributed`` section runs as a world of one.

    Args:
        cfg: The recipe's ``distributed`` section.
        device_spec: ``run.device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``): on CUDA each rank takes
            ``cuda:LOCAL_RANK``.
    """
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not device_spec.startswith("cpu")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


# ----------------------------------------------------------------------------------------------------- backend


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
        data, error = _read_ds_config(cfg.deepspeed_config)
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


def _is_zero_param(p: nn.Parameter) -> bool:
    return hasattr(p, "_hp_mapping") or hasattr(p, "ds_id")


class ConsolidatedOptimizerState:
    """The DeepSpeed-wrapped torch optimizer seen through the per-parameter ``state_dict`` of a plain torch
    optimizer over the trainable parameters (the :class:`~rlpost.engine.backend.LocalBackend` checkpoint format).

    ZeRO keeps optimizer state as flat fp32 partitions, one slice per rank; ``state_dict`` gathers each parameter's
    full state (``deepspeed.utils.safe_get_full_optimizer_state``, collective) so a checkpoint does not depend on
    the number of ranks, and ``load_state_dict`` scatters it back into whatever partitioning the new run has.
    """

    def __init__(self, engine: Any, client: torch.optim.Optimizer, parameters: list[nn.Parameter]) -> None:
        self.engine = engine
        self.client = client
        self.parameters = parameters

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The live parameter groups (learning rate etc.)."""
        groups: list[dict[str, Any]] = self.engine.optimizer.param_groups
        return groups

    def _inner(self) -> torch.optim.Optimizer:
        """The torch optimizer that owns the (flat, partitioned) state tensors."""
        opt = self.engine.optimizer
        inner: torch.optim.Optimizer = getattr(opt, "optimizer", opt)
        return inner

    def _sharded(self) -> bool:
        return any(_is_zero_param(p) for p in self.parameters)

    def state_dict(self) -> dict[str, Any]:
        """Per-parameter state keyed ``0..n-1`` and one parameter group; a collective call under ZeRO."""
        from deepspeed.utils import safe_get_full_optimizer_state

        if not self._sharded():
            return self.client.state_dict()
        inner = self._inner()
        sample: dict[str, Any] = next(iter(inner.state.values()), {})
        keys = sorted(k for k, v in sample.items() if isinstance(v, Tensor) and v.numel() > 1)
        scalars = {k: v for k, v in sample.items() if k not in keys}
        state: dict[int, dict[str, Any]] = {}
        if sample:
            for i, p in enumerate(self.parameters):
                entry: dict[str, Any] = {
                    k: (v.detach().cpu().clone() if isinstance(v, Tensor) else v) for k, v in scalars.items()
                }
                for k in keys:
                    full = safe_get_full_optimizer_state(p, k)
                    entry[k] = (
                        full.detach().float().cpu().clone().reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                    )
                state[i] = entry
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.parameters)))
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Scatter a per-parameter state into this run's partitions; hyper-parameters of the group are restored."""
        from deepspeed.utils import safe_set_full_optimizer_state

        if not self._sharded():
            self.client.load_state_dict(state_dict)
            return
        saved_group = state_dict["param_groups"][0]
        for group in self.param_groups:
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        states = state_dict["state"]
        if not states:
            return
        first = next(iter(states.values()))
        keys = [k for k, v in first.items() if isinstance(v, Tensor) and v.dim() > 0]
        inner = self._inner()
        # torch optimizers create their state lazily at the first step; create the flat tensors now so the
        # fragments can be written into them (and re-link DeepSpeed's per-parameter views of that state).
        # ZeRO-3 hands its fp32 partitions to the torch optimizer only during step() (its param groups are empty
        # in between), so take them from the ZeRO optimizer itself.
        flats = getattr(self.engine.optimizer, "fp32_partitioned_groups_flat", None)
        if flats is None:
            flats = [flat for group in inner.param_groups for flat in group["params"]]
        for flat in flats:
            if not inner.state.get(flat):
                inner.state[flat] = {k: torch.zeros_like(flat) for k in keys}
            for k, v in first.items():
                if k not in keys:
                    inner.state[flat][k] = v.clone() if isinstance(v, Tensor) else v
        relink = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if callable(relink):
            relink()
        for i, p in enumerate(self.parameters):
            for k in keys:
                safe_set_full_optimizer_state(p, states[i][k].to(torch.float32), k)


class _FragmentShards:
    """EMA shares under ZeRO 1/2 (and DeepSpeed's bf16 optimizer): every rank holds the full low-precision
    parameters, while the fp32 master weights are flattened and cut into one contiguous partition per rank, so one
    parameter's master copy may be split over two ranks. A rank's share of a parameter is its fragment of that
    partition (``p._hp_mapping``; none when the parameter lies wholly in other ranks' partitions).
    """

    def __init__(self, parameters: Sequence[nn.Parameter]) -> None:
        self.parameters = list(parameters)

    def local(self) -> list[Tensor]:
        """This rank's fp32 master fragment of each parameter (views, re-read every call: DeepSpeed re-links them
        when it offloads and reloads its state)."""
        out = []
        for p in self.parameters:
            mapping = p._hp_mapping  # type: ignore[attr-defined]
            frag = mapping.get_hp_fragment() if mapping is not None else None
            out.append(frag.detach() if frag is not None else torch.empty(0, dtype=torch.float32, device=p.device))
        return out

    def _full(self, p: nn.Parameter, shard: Tensor) -> Tensor:
        # As deepspeed.utils.tensor_fragment.get_full_hp_param assembles the master weights: each rank writes its
        # fragment into a zero buffer and the buffers are summed (exact: every element has one non-zero term).
        import deepspeed.comm as dist

        buf = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        mapping = p._hp_mapping  # type: ignore[attr-defined]
        if mapping is not None:
            addr = mapping.lp_fragment_address
            buf.narrow(0, addr.start, addr.numel).copy_(shard)
        dist.all_reduce(buf, group=p._dp_group)  # type: ignore[attr-defined]
        return buf.view(p.shape)

    def gather(self, shards: Sequence[Tensor]) -> list[Tensor]:
        """Full fp32 tensors; collective (one all-reduce per parameter)."""
        return [self._full(p, s) for p, s in zip(self.parameters, shards, strict=True)]

    def scatter(self, full: Sequence[Tensor]) -> list[Tensor]:
        """This rank's fragment of each full tensor."""
        out = []
        for i, (p, value) in enumerate(zip(self.parameters, full, strict=True)):
            if value.numel() != p.numel():
                raise CheckpointError(f"EMA tensor {i}: checkpoint shape {tuple(value.shape)} != {tuple(p.shape)}")
            mapping = p._hp_mapping  # type: ignore[attr-defined]
            if mapping is None:
                out.append(torch.empty(0, dtype=torch.float32))
                continue
            addr = mapping.lp_fragment_address
            out.append(value.reshape(-1).narrow(0, addr.start, addr.numel).to(torch.float32))
        return out

    def loaded(self, shards: Sequence[Tensor]) -> AbstractContextManager[None]:
        """Gather each parameter's EMA into the (replicated) low-precision parameter; restore it locally on exit.
        Collective on entry only (one gather per parameter, lazily, just before its copy)."""
        return swapped_in(self.parameters, (self._full(p, s) for p, s in zip(self.parameters, shards, strict=True)))


class _Zero3Shards:
    """EMA shares under ZeRO-3: each parameter is cut into equal (zero-padded) partitions, one per rank; the module
    gathers them on demand from ``p.ds_tensor`` (low precision), the optimizer updates an fp32 copy of the same
    partition. A rank's share is that fp32 partition, padding included.
    """

    def __init__(self, parameters: Sequence[nn.Parameter], device: torch.device) -> None:
        self.parameters = list(parameters)
        self.device = device

    def local(self) -> list[Tensor]:
        """This rank's fp32 master partition of each parameter (``deepspeed.utils.safe_get_local_fp32_param``)."""
        from deepspeed.utils import safe_get_local_fp32_param

        return [safe_get_local_fp32_param(p).detach() for p in self.parameters]

    def _full(self, p: nn.Parameter, shard: Tensor) -> Tensor:
        # The inverse of the partitioning: concatenate the ranks' partitions, drop the padding (as ZeRO-3's
        # _fp32_state_allgather does for the master weights).
        import deepspeed.comm as dist

        group = p.ds_process_group  # type: ignore[attr-defined]
        buf = torch.empty(dist.get_world_size(group=group) * shard.numel(), dtype=torch.float32, device=self.device)
        dist.all_gather_into_tensor(buf, shard.to(self.device, torch.float32).contiguous(), group=group)
        return buf.narrow(0, 0, p.ds_numel).view(p.ds_shape)  # type: ignore[attr-defined]

    def gather(self, shards: Sequence[Tensor]) -> list[Tensor]:
        """Full fp32 tensors; collective (one all-gather per parameter)."""
        return [self._full(p, s) for p, s in zip(self.parameters, shards, strict=True)]

    def scatter(self, full: Sequence[Tensor]) -> list[Tensor]:
        """This rank's (zero-padded) partition of each full tensor."""
        import deepspeed.comm as dist

        out = []
        for i, (p, value) in enumerate(zip(self.parameters, full, strict=True)):
            if value.numel() != p.ds_numel:  # type: ignore[attr-defined]
                raise CheckpointError(
                    f"EMA tensor {i}: checkpoint shape {tuple(value.shape)} != {tuple(p.ds_shape)}"  # type: ignore[attr-defined]
                )
            group = p.ds_process_group  # type: ignore[attr-defined]
            size = p.ds_tensor.ds_numel  # type: ignore[attr-defined]
            padded = torch.zeros(size * dist.get_world_size(group=group), dtype=torch.float32)
            padded[: value.numel()] = value.reshape(-1)
            out.append(padded.narrow(0, size * dist.get_rank(group=group), size))
        return out

    @contextmanager
    def loaded(self, shards: Sequence[Tensor]) -> Iterator[None]:
        """Write the EMA partitions into the module's partitions (``ds_tensor``) and back up the live ones; the fp32
        master weights are never touched. Collective on entry and on exit."""
        backup = [p.ds_tensor.detach().clone() for p in self.parameters]  # type: ignore[attr-defined]
        _write_zero3_partitions(self.parameters, shards)
        try:
            yield
        finally:
            _write_zero3_partitions(self.parameters, backup)


@torch.no_grad()
def _write_zero3_partitions(parameters: Sequence[nn.Parameter], partitions: Sequence[Tensor]) -> None:
    """Write this rank's partition of each ZeRO-3 parameter into the module's copy (``ds_tensor``, what forward
    passes gather); a collective call.

    Gathered copies are stale afterwards: free them, drop ZeRO++'s secondary partitions (rebuilt at the next gather)
    and gather the persistent parameters (small ones ZeRO-3 keeps whole on every rank) again; the others are
    gathered on demand by the forward hooks. These are the steps ZeRO-3 takes around loading its own checkpoints
    (``checkpoint_event_prologue`` / ``checkpoint_event_epilogue`` in deepspeedai/DeepSpeed
    deepspeed/runtime/zero/stage3.py@v0.19.8).
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for p, part in zip(parameters, partitions, strict=True):
        p.ds_tensor.copy_(part.reshape(-1))  # type: ignore[attr-defined]
    available = [p for p in parameters if p.ds_status == ZeroParamStatus.AVAILABLE]  # type: ignore[attr-defined]
    if available:
        available[0].partition(available)  # type: ignore[attr-defined]
    for p in parameters:
        if getattr(p, "ds_secondary_tensor", None) is not None:
            p.ds_secondary_tensor = None  # type: ignore[attr-defined]
    persistent = [p for p in parameters if p.ds_persist]  # type: ignore[attr-defined]
    if persistent:
        persistent[0].all_gather(persistent)  # type: ignore[attr-defined]


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
            return _Zero3Shards(self.parameters, self.world.device)
        if any(hasattr(p, "_hp_mapping") for p in self.parameters):
            return _FragmentShards(self.parameters)
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
            full = safe_get_full_fp32_param(p) if _is_zero_param(p) else None
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
            if _is_zero_param(p):
                safe_set_full_fp32_param(p, value.to(self.world.device))
        if zero3:
            # The fp32 master partitions alone would reach the module only after the next optimizer step (ZeRO-3
            # copies master -> module partitions in step()): copy them now, as step() does.
            _write_zero3_partitions(zero3, _Zero3Shards(zero3, self.world.device).local())


def policy_module(policy: object) -> nn.Module | None:
    """The module DeepSpeed wraps: the policy's denoiser (``transformer``) when it exposes one."""
    module = getattr(policy, "transformer", None)
    return module if isinstance(module, nn.Module) else None


GatherFn = Callable[[Any], list[Any]]
