"""State that DeepSpeed ZeRO partitions over ranks, seen whole: the optimizer state in the per-parameter format of a
plain torch optimizer (:class:`ConsolidatedOptimizerState`, so a checkpoint does not depend on the number of ranks),
and each rank's share of the fp32 master weights for the EMA (:class:`FragmentShards` under ZeRO 1/2,
:class:`Zero3Shards` under ZeRO-3).

Used by :class:`rlpost.engine.distributed.DeepSpeedBackend`; ``deepspeed`` is imported lazily, inside functions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from rlpost.engine.checkpoint import CheckpointError
from rlpost.engine.ema import swapped_in

__all__ = [
    "ConsolidatedOptimizerState",
    "FragmentShards",
    "Zero3Shards",
    "is_zero_param",
    "write_zero3_partitions",
]


def is_zero_param(p: nn.Parameter) -> bool:
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
        return any(is_zero_param(p) for p in self.parameters)

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


class FragmentShards:
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


class Zero3Shards:
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
        write_zero3_partitions(self.parameters, shards)
        try:
            yield
        finally:
            write_zero3_partitions(self.parameters, backup)


@torch.no_grad()
def write_zero3_partitions(parameters: Sequence[nn.Parameter], partitions: Sequence[Tensor]) -> None:
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
