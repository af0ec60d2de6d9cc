"""MixGRPO: window scheduler sequences (progressive with stride/τ/roll-back, random, decay), the window sampler and
Flash's compressed DPM-Solver++ tail (counts vs forward_count, ratio 1), and a 2-iteration CLI run."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.models import LoraSpec
from rlpost.ops.schedules import sd3_sigmas
from rlpost_mixgrpo.sampler import MixGRPOSampler, compressed_tail
from rlpost_mixgrpo.window import WindowScheduler
from tests.argument_checks import problems_of
from tests.unit.components.chain_helpers import (
    check_end_to_end,
    check_rollout_contract,
    perturb_lora,
    train_two_iterations,
)


def test_progressive_overlapping_roll_back() -> None:
    # T=10 -> windows in [0, 8); w=3 -> last full window starts at 5; stride 1, move every 2 iterations
    s = WindowScheduler(num_steps=10, window_size=3, shift_interval=2, stride=1)
    assert s.sequence(14) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 0, 0]


def test_progressive_non_overlapping_and_clip() -> None:
    s = WindowScheduler(num_steps=10, window_size=2, shift_interval=1)  # stride defaults to w
    assert s.sequence(6) == [0, 2, 4, 6, 0, 2]
    clip = WindowScheduler(num_steps=10, window_size=3, shift_interval=1, stride=2, roll_back=False)
    assert clip.sequence(6) == [0, 2, 4, 5, 5, 5]
    frozen = WindowScheduler(num_steps=10, window_size=4, shift_interval=1, stride=0)  # MixGRPO-Flash*
    assert frozen.sequence(4) == [0, 0, 0, 0]


def test_random_strategy_is_uniform_per_move_and_resumable() -> None:
    s = WindowScheduler(num_steps=10, window_size=3, shift_interval=2, strategy="random", seed=7)
    seq = s.sequence(40)
    assert all(seq[i] == seq[i + 1] for i in range(0, 40, 2))  # held for τ = 2 iterations
    assert set(seq) <= set(range(6)) and len(set(seq)) > 2
    # each move's start is the seeded draw for that move index
    expected = [
        int(torch.randint(0, 6, (1,), generator=torch.Generator().manual_seed(7 * 1_000_003 + m))) for m in range(20)
    ]
    assert seq[::2] == expected
    resumed = WindowScheduler(num_steps=10, window_size=3, shift_interval=2, strategy="random", seed=7)
    resumed.load_state_dict(s.state_dict())
    assert resumed.sequence(6) == s.sequence(6)


def test_decay_strategy_shortens_interval() -> None:
    s = WindowScheduler(
        num_steps=10,
        window_size=2,
        shift_interval=4,
        strategy="decay",
        stride=1,
        decay_rate=math.log(2),
        decay_offset=1,
    )
    # τ(start) = max(1, int(4 · 2^-(start-1)+)): 4, 4, 2, 1, 1, 1, 1 (starts 0..6), then roll back
    assert [s.interval() for _ in range(1)] == [4]
    seq = s.sequence(4 + 4 + 2 + 1 + 1 + 1 + 1 + 2)
    assert seq == [0] * 4 + [1] * 4 + [2] * 2 + [3, 4, 5, 6] + [0, 0]


def test_validate_rejects_window_larger_than_schedule() -> None:
    problems = MixGRPOSampler(num_steps=6, window_size=5).validate(None)
    assert any(p.startswith("sampler.init_args.window_size") for p in problems)
    (ratio,) = problems_of(MixGRPOSampler, "sampler", dpm_after_window=True, compress_ratio=0.0)
    assert ratio == "sampler.init_args.compress_ratio: must be in (0, 1], got 0.0"
    assert any("shift_interval" in p for p in MixGRPOSampler(shift_interval=0).validate(None))
    assert MixGRPOSampler().validate(None) == []


def test_compressed_tail() -> None:
    sig = sd3_sigmas(10, 3.0)
    tail = compressed_tail(float(sig[4]), 6, 0.4, 3.0)
    assert tail.shape == (3,) and float(tail[0]) == float(sig[4]) and float(tail[-1]) == 0.0
    assert (tail[1:] < tail[:-1]).all()
    # definition: unshift σ_end (t = σ / (s - (s-1)σ)), space linearly to 0, shift again
    t = float(sig[4]) / (3.0 - 2.0 * float(sig[4]))
    grid = torch.tensor([t, t / 2, 0.0], dtype=torch.float64)
    torch.testing.assert_close(tail, (3.0 * grid / (1 + 2.0 * grid)).float(), atol=1e-6, rtol=0)
    assert compressed_tail(0.5, 1, 0.2, 3.0).shape == (2,)  # at least one step


def test_window_sampler_counts_ratio_and_schedule(make_sd3_policy) -> None:
    policy = make_sd3_policy(lora=LoraSpec(rank=4, alpha=8), guidance_scale=2.0)
    perturb_lora(policy, seed=2)
    sampler = MixGRPOSampler(num_steps=6, window_size=2, shift_interval=1, window_stride=1)
    for expected_start in (0, 1):
        sampler.begin_step(expected_start, torch.Generator())
        rollout = check_rollout_contract(sampler, policy, groups=2, per_group=2, seed=expected_start)
        assert rollout.stats["sampler/window_start"] == expected_start
        steps = rollout.node_step[rollout.edge_parent]
        assert torch.equal(rollout.trainable, (steps >= expected_start) & (steps < expected_start + 2))
        assert torch.isnan(rollout.old_log_probs[~rollout.trainable]).all()
    assert sampler.state_dict() == {"window": {"start": 1, "iteration": 1, "since_move": 0, "moves": 1}}


def test_flash_sampler_compresses_after_the_window(make_sd3_policy) -> None:
    policy = make_sd3_policy(lora=LoraSpec(rank=4, alpha=8), guidance_scale=1.0)
    perturb_lora(policy, seed=3)
    sampler = MixGRPOSampler(
        num_steps=8, window_size=2, shift_interval=1, window_stride=2, dpm_after_window=True, compress_ratio=0.4
    )
    for step, end in enumerate((2, 4, 6)):  # 6 remaining -> 2 steps, 4 -> 1, 2 -> 1
        sampler.begin_step(step, torch.Generator())
        assert sampler.counts(1, 3).rollout_forwards == 3 * (end + max(1, math.floor((8 - end) * 0.4)))
        rollout = check_rollout_contract(sampler, policy, groups=1, per_group=3, seed=end)
        assert rollout.kernels[2] == "dpm-solver++2"
        assert int((rollout.edge_kernel == 2).sum()) == 3 * max(1, math.floor((8 - end) * 0.4))
        assert rollout.sigmas.shape[0] == end + max(1, math.floor((8 - end) * 0.4)) + 1
        assert float(rollout.sigmas[-1]) == 0.0
    with pytest.raises(ValueError, match="deterministic"):
        sampler.evaluate(policy, rollout, (rollout.edge_kernel == 2).nonzero().flatten())


def test_two_iterations_end_to_end(tiny_sd3_dir, tmp_path) -> None:
    lines, probe = train_two_iterations("recipes/tiny/mixgrpo.yaml", tiny_sd3_dir, tmp_path / "run")
    check_end_to_end(lines, probe)
    assert [line["sampler/window_start"] for line in lines] == [0.0, 1.0]
    assert lines[0]["train/edges"] == 8 * 2


def _starts_over_run(sampler: MixGRPOSampler, steps: int, seconds: float = 0.0) -> list[int]:
    """The window start of each of ``steps`` training steps, driven as the runner drives a sampler."""
    out = []
    for step in range(steps):
        sampler.begin_run_step(step, steps)
        sampler.begin_step(step, torch.Generator())
        out.append(sampler.scheduler.window()[0])
        sampler.end_run_step(seconds)
    return out


def test_window_over_the_runs_steps_sweeps_every_start_once() -> None:
    # T = 10, w = 2: starts 0..6 (limit T - 2 = 8), stride 1 -> 7 starts, each for 1/7 of the run.
    sampler = MixGRPOSampler(num_steps=10, window_size=2, window_stride=1, shift_over="steps")
    assert sampler.validate(None) == []
    starts = _starts_over_run(sampler, 71)
    assert starts[0] == 0 and starts[-1] == 6 and starts == sorted(starts)
    assert [starts.count(s) for s in range(7)] == [10, 10, 10, 10, 10, 10, 11]  # p = step / 70: 10 steps per start
    # The same recipe over a run twice as long moves half as often: the schedule follows the run, not a count.
    longer = _starts_over_run(MixGRPOSampler(num_steps=10, window_size=2, window_stride=1, shift_over="steps"), 141)
    assert [longer.count(s) for s in range(7)] == [20, 20, 20, 20, 20, 20, 21]


def test_window_over_a_time_budget_follows_the_seconds_and_resumes() -> None:
    make = lambda: MixGRPOSampler(num_steps=10, window_size=2, window_stride=2, shift_over="time", budget_s=8.0)  # noqa: E731
    sampler = make()  # starts 0, 2, 4, 6: a quarter of the budget each
    assert _starts_over_run(sampler, 6, seconds=2.0) == [0, 2, 4, 6, 6, 6]  # the last once the budget is spent
    slow = make()
    assert _starts_over_run(slow, 6, seconds=1.0) == [0, 0, 2, 2, 4, 4]  # half the speed: half as far
    resumed = make()
    resumed.load_state_dict(slow.state_dict())
    resumed.begin_run_step(6, 100)
    resumed.begin_step(6, torch.Generator())
    assert resumed.scheduler.window()[0] == 6  # 6 of 8 s spent
    assert slow.state_dict()["spent_s"] == 6.0


def test_window_over_the_run_is_checked() -> None:
    assert "budget_s: shift_over: time needs the run's training-time budget" in " ".join(
        MixGRPOSampler(shift_over="time").validate(None)
    )
    assert "only used with shift_over: time" in " ".join(MixGRPOSampler(budget_s=60.0).validate(None))
    assert "sweeps a progressive window" in " ".join(
        MixGRPOSampler(shift_over="steps", window_strategy="random").validate(None)
    )
    assert "sweeps a progressive window" in " ".join(MixGRPOSampler(shift_over="steps", window_stride=0).validate(None))
    # The default stays upstream's: every shift_interval iterations.
    default = MixGRPOSampler(num_steps=10, window_size=2, shift_interval=2)
    assert _starts_over_run(default, 5) == [0, 0, 1, 1, 2]
