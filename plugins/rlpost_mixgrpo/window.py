"""MixGRPO's sliding-window scheduler (``Tencent-Hunyuan/MixGRPO`` ``fastvideo/utils/grpo_states.py``@e5cdd6a,
``training_strategy="part"``), restated.

The window is ``w`` consecutive schedule steps ``[start, start + w)`` that use the SDE and are trained; every other
step is an ODE step. Windows live in ``[0, limit)`` with ``limit = T - 2`` by default (upstream's
``max_timesteps = sampling_steps - 2``). The scheduler counts training iterations (steps): the sampler brings it to
the step about to run in ``begin_step`` (:meth:`WindowScheduler.advance_to`), once per step whatever the number of
ranks and prompt groups, and it moves the window every ``τ`` (``shift_interval``) iterations:

* ``progressive``: ``start += stride`` (upstream ``--prog_overlap_step``; ``stride = w`` is upstream's
  non-overlapping default move, ``0`` freezes the window as in MixGRPO-Flash*). A window that would run past
  ``limit`` rolls back to ``start = 0`` (``roll_back``) or stops at the last full window ``limit - w``.
* ``random``: at each move ``start ~ UniformInt[0, limit - w]`` (drawn from a generator seeded by ``(seed, move
  index)``, so a resumed run draws the same windows).
* ``decay``: progressive moves, but the interval shrinks as the window moves towards the image end:
  ``τ(start) = max(1, int(τ · exp(-decay_rate · max(0, start - decay_offset))))`` (upstream ``exp_decay`` with
  ``k = 0.1`` and offset 13 at 25 steps).

Windows are never truncated (every iteration trains exactly ``w`` steps per sample, so per-step counts are closed
form); this is our reading of upstream's ``min(start + w, max)`` bound.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

__all__ = ["WindowScheduler", "WindowStrategy"]

WindowStrategy = Literal["progressive", "random", "decay"]

_SEED_STRIDE = 1_000_003


class WindowScheduler:
    """Stateful window position across training iterations.

    Args:
        num_steps: Sampling steps ``T``.
        window_size: Window length ``w`` (SDE, trained steps per sample).
        shift_interval: ``τ``, iterations between window moves.
        strategy: ``"progressive"``, ``"random"`` or ``"decay"``.
        stride: Steps the window moves by (progressive/decay); ``None`` means ``w``.
        roll_back: Progressive/decay: restart at 0 after the last window (else stay at the last window).
        limit: Windows lie in ``[0, limit)``; ``None`` means ``T - 2``.
        decay_rate: ``k`` of the decay strategy.
        decay_offset: Window start after which the decay strategy shortens ``τ``.
        seed: Seed of the random strategy.
    """

    def __init__(
        self,
        num_steps: int,
        window_size: int,
        shift_interval: int,
        strategy: WindowStrategy = "progressive",
        stride: int | None = None,
        roll_back: bool = True,
        limit: int | None = None,
        decay_rate: float = 0.1,
        decay_offset: int = 13,
        seed: int = 0,
    ) -> None:
        self.num_steps = int(num_steps)
        self.window_size = int(window_size)
        self.shift_interval = int(shift_interval)
        self.strategy = strategy
        self.stride = self.window_size if stride is None else int(stride)
        self.roll_back = bool(roll_back)
        self.limit = self.num_steps - 2 if limit is None else int(limit)
        self.decay_rate = float(decay_rate)
        self.decay_offset = int(decay_offset)
        self.seed = int(seed)
        self.iteration = 0
        self.since_move = 0
        self.moves = 0
        self.start = self._random_start() if strategy == "random" and self.problems() == [] else 0

    # ------------------------------------------------------------------------------------------------ checks
    def problems(self) -> list[str]:
        """Human-readable problems with the settings (field names relative to the sampler's ``init_args``)."""
        out = []
        if self.window_size < 1:
            out.append(f"window_size: must be >= 1, got {self.window_size}")
        if self.limit > self.num_steps or self.limit < 1:
            out.append(f"window_limit: must be in [1, num_steps={self.num_steps}], got {self.limit}")
        elif self.window_size > self.limit:
            out.append(
                f"window_size: a window of {self.window_size} steps does not fit the {self.limit} schedule steps "
                f"available to windows (num_steps {self.num_steps} - 2)"
            )
        if self.shift_interval < 1:
            out.append(f"shift_interval: must be >= 1 iteration, got {self.shift_interval}")
        if self.stride < 0:
            out.append(f"window_stride: must be >= 0, got {self.stride}")
        if self.strategy not in ("progressive", "random", "decay"):
            out.append(f"window_strategy: must be 'progressive', 'random' or 'decay', got {self.strategy!r}")
        if self.decay_rate < 0:
            out.append(f"decay_rate: must be >= 0, got {self.decay_rate}")
        return out

    # ---------------------------------------------------------------------------------------------- schedule
    def window(self) -> tuple[int, int]:
        """The current window ``(start, end)``: steps ``start <= i < end`` are SDE and trained."""
        return self.start, self.start + self.window_size

    def interval(self) -> int:
        """Iterations the window stays at the current start (``τ``, or the decayed ``τ``)."""
        if self.strategy == "decay":
            excess = max(0, self.start - self.decay_offset)
            return max(1, int(self.shift_interval * math.exp(-self.decay_rate * excess)))
        return self.shift_interval

    def advance_to(self, step: int) -> tuple[int, int]:
        """Advance until :attr:`iteration` equals ``step`` and return that step's window.

        Idempotent for one step (a second call for the same step does not advance), so the window advances once per
        training step; a scheduler restored from a checkpoint continues from its saved iteration.

        Raises:
            ValueError: When the scheduler is already past ``step`` (steps must be begun in order).
        """
        if step < self.iteration:
            raise ValueError(
                f"window scheduler is at iteration {self.iteration}, past step {step}: steps must be begun in order "
                "(a sampler instance belongs to one run)"
            )
        while self.iteration < step:
            self.advance()
        return self.window()

    def advance(self) -> None:
        """Count one finished iteration; move the window when its interval is over."""
        self.iteration += 1
        self.since_move += 1
        if self.since_move >= self.interval():
            self.since_move = 0
            self.moves += 1
            self._move()

    def _move(self) -> None:
        if self.strategy == "random":
            self.start = self._random_start()
            return
        last = self.limit - self.window_size
        nxt = self.start + self.stride
        if nxt > last:
            nxt = 0 if self.roll_back else last
        self.start = nxt

    def _random_start(self) -> int:
        gen = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + self.moves)
        return int(torch.randint(0, self.limit - self.window_size + 1, (1,), generator=gen))

    def sequence(self, iterations: int) -> list[int]:
        """Window starts of the next ``iterations`` iterations (advances this scheduler)."""
        out = []
        for _ in range(iterations):
            out.append(self.start)
            self.advance()
        return out

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Position and counters (JSON-serialisable)."""
        return {"start": self.start, "iteration": self.iteration, "since_move": self.since_move, "moves": self.moves}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.start = int(state["start"])
        self.iteration = int(state["iteration"])
        self.since_move = int(state["since_move"])
        self.moves = int(state["moves"])
