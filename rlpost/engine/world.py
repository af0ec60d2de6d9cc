"""This process's place among the ranks (:class:`World`) and the start-up of the process group (:func:`init_world`).

``torchrun`` and the ``deepspeed`` launcher export the rank variables; a plain ``rlpost train`` with a
``distributed`` section runs as a world of one. ``deepspeed`` is imported lazily, inside :func:`init_world`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from rlpost.engine.distributed_config import DistributedConfig

__all__ = ["World", "init_world"]


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
