"""rlpost.engine.lr_schedule: a learning-rate schedule over the run's length (``run.max_steps``) or time budget,
driven by the runner, with no ``total_iters`` to work out."""

from __future__ import annotations

import math
import re

import pytest
import torch

import rlpost
from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.backend import LocalBackend
from rlpost.engine.lr_schedule import RunLengthLR, bind_time_budget
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe

LR = 0.1


@pytest.fixture
def host() -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components,))


def _run_lrs(tmp_path, host, steps: int, **init_args) -> list[float]:
    """``train/lr`` of every step of a toy run whose ``lr_scheduler`` is ``rlpost.RunLengthLR(**init_args)``."""
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=steps, device="cpu")
    cfg["lr_scheduler"] = {"class_path": "rlpost.RunLengthLR", "init_args": init_args}
    # Two optimizer steps per training step: the schedule moves per training step, not per optimizer step.
    cfg["optimizer"]["init_args"]["inner_epochs"] = 2
    history = Runner(validate(cfg, host), host).run()
    assert all(m["train/optimizer_steps"] == 2 for m in history)
    return [m["train/lr"] for m in history]


def _scheduler(**kwargs) -> tuple[torch.optim.Optimizer, RunLengthLR]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    return optimizer, RunLengthLR(optimizer, **kwargs)


def test_facade_exports_the_schedule():
    assert rlpost.RunLengthLR is RunLengthLR


def test_linear_reaches_final_at_the_last_step(tmp_path, host):
    lrs = _run_lrs(tmp_path, host, 5, shape="linear", final=0.2)
    # p = step / (max_steps - 1): the first step trains at the peak, the last at final x peak.
    expected = [LR * (1 - 0.8 * i / 4) for i in range(5)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[-1] == pytest.approx(0.2 * LR)


def test_cosine_reaches_final_at_the_last_step(tmp_path, host):
    lrs = _run_lrs(tmp_path, host, 5, shape="cosine")
    expected = [LR * 0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(5)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert lrs[0] == pytest.approx(LR) and lrs[2] == pytest.approx(LR / 2) and lrs[-1] == pytest.approx(0.0, abs=1e-15)


def test_warmup_ramps_from_zero_to_the_peak_then_follows_the_shape(tmp_path, host):
    lrs = _run_lrs(tmp_path, host, 9, shape="linear", warmup=0.25, final=0.0)
    # p = i / 8; warmup to p = 0.25 (steps 0, 1), peak at step 2, then linear over q = (p - 0.25) / 0.75.
    assert lrs[:3] == pytest.approx([0.0, LR / 2, LR])
    assert lrs[2:] == pytest.approx([LR * (1 - (i / 8 - 0.25) / 0.75) for i in range(2, 9)], abs=1e-15)
    constant = _scheduler(shape="constant", warmup=0.5)[1]
    assert [constant.factor(p) for p in (0.0, 0.25, 0.5, 0.9, 1.0)] == [0.0, 0.5, 1.0, 1.0, 1.0]


def test_progress_over_time_follows_the_training_seconds_and_stays_at_final():
    optimizer, scheduler = _scheduler(shape="linear", over="time", budget_s=10.0, final=0.1)
    seen = []
    for step, seconds in enumerate([2.5, 5.0, 2.5, 4.0, 1.0]):
        scheduler.begin_step(step, 3)  # the step count plays no part over time
        seen.append(optimizer.param_groups[0]["lr"])
        scheduler.step()  # the backend's call after an optimizer step recomputes the same value
        assert optimizer.param_groups[0]["lr"] == seen[-1]
        scheduler.end_step(seconds)
    # Elapsed 0, 2.5, 7.5, 10, 14 s of a 10 s budget: factor 1 - 0.9 p, p capped at 1.
    assert seen == pytest.approx([LR, LR * (1 - 0.9 * 0.25), LR * (1 - 0.9 * 0.75), 0.1 * LR, 0.1 * LR])
    assert scheduler.elapsed_s == 15.0
    scheduler.end_step(float("nan"))  # a non-finite or negative wall time adds nothing
    scheduler.end_step(-1.0)
    assert scheduler.elapsed_s == 15.0


def test_learning_rate_is_constant_over_a_training_steps_optimizer_steps():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=LR)
    scheduler = RunLengthLR(optimizer, shape="linear")
    backend = LocalBackend([param], optimizer, scheduler, max_grad_norm=None)
    scheduler.begin_step(1, 3)
    for _ in range(3):
        (param**2).sum().backward()
        assert backend.step()["train/lr"] == pytest.approx(LR / 2)


def test_resume_over_time_restores_the_training_seconds(tmp_path, host):
    def cfg(steps):
        cfg = toy_recipe(str(tmp_path / "run"), max_steps=steps, device="cpu")
        sched = {"shape": "linear", "over": "time", "budget_s": 1e4}
        cfg["lr_scheduler"] = {"class_path": "rlpost.RunLengthLR", "init_args": sched}
        cfg["checkpoint"] = {"every": 1, "keep_last": 2}
        return cfg

    first = Runner(validate(cfg(2), host), host)
    first.run()
    spent = first.backend.scheduler.elapsed_s
    assert spent == pytest.approx(sum(m["perf/step_sec"] for m in first.ctx.history)) and spent > 0
    resumed = Runner(validate(cfg(3), host), host, resume="latest")
    resumed.setup()
    scheduler = resumed.backend.scheduler
    assert isinstance(scheduler, RunLengthLR) and scheduler.elapsed_s == spent  # saved in the checkpoint, exactly
    scheduler.begin_step(resumed.ctx.step, 3)
    assert resumed.backend.optimizer.param_groups[0]["lr"] == pytest.approx(LR * (1 - spent / 1e4), rel=1e-12)


def test_state_dict_holds_progress_not_the_recipe_arguments():
    _, a = _scheduler(shape="linear", over="time", budget_s=10.0)
    a.begin_step(4, 10)
    a.end_step(3.0)
    state = a.state_dict()
    assert {"step_index", "max_steps", "elapsed_s"} <= state.keys()
    assert not {"shape", "warmup", "final", "over", "budget_s"} & state.keys()
    optimizer, b = _scheduler(shape="cosine", over="time", budget_s=6.0)  # the resumed recipe changed its arguments
    b.load_state_dict(state)
    assert (b.shape, b.budget_s, b.elapsed_s, b.step_index) == ("cosine", 6.0, 3.0, 4)
    b.begin_step(5, 10)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shape": "cosin"}, "lr_scheduler.init_args.shape: must be one of linear, cosine, constant, got 'cosin'"),
        ({"over": "epochs"}, "lr_scheduler.init_args.over: must be one of steps, time, got 'epochs'"),
        ({"warmup": 1.0}, "lr_scheduler.init_args.warmup: must be a fraction of the run in [0, 1), got 1.0"),
        ({"warmup": float("nan")}, "lr_scheduler.init_args.warmup: must be a fraction of the run in [0, 1)"),
        ({"final": 1.5}, "lr_scheduler.init_args.final: must be a factor in [0, 1] or null, got 1.5"),
        ({"shape": "constant", "final": 0.0}, "lr_scheduler.init_args.final: has no effect with shape constant"),
        ({"over": "time"}, "lr_scheduler.init_args.budget_s: over: time needs the run's training-time budget"),
        ({"over": "time", "budget_s": 0}, "lr_scheduler.init_args.budget_s: must be a positive number of seconds"),
        ({"budget_s": 60}, "lr_scheduler.init_args.budget_s: only used with over: time"),
    ],
)
def test_bad_arguments_name_their_field(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        _scheduler(**kwargs)


def test_every_bad_argument_is_reported_at_once():
    with pytest.raises(ValueError) as info:
        _scheduler(shape="cosin", warmup=-0.1, over="time")
    assert str(info.value).count("lr_scheduler.init_args.") == 3


def test_bench_binds_its_time_budget_to_a_schedule_over_time():
    over_time = {"class_path": "rlpost.RunLengthLR", "init_args": {"over": "time"}}
    assert bind_time_budget(over_time, 80.0) == {
        "class_path": "rlpost.RunLengthLR",
        "init_args": {"over": "time", "budget_s": 80.0},
    }
    dotted = {"class_path": "rlpost.engine.lr_schedule.RunLengthLR", "init_args": {"over": "time"}}
    assert bind_time_budget(dotted, 80.0)["init_args"]["budget_s"] == 80.0
    # Kept as written: a budget of its own, a schedule over steps, another scheduler.
    own = {"class_path": "RunLengthLR", "init_args": {"over": "time", "budget_s": 30}}
    steps = {"class_path": "rlpost.RunLengthLR", "init_args": {"over": "steps"}}
    poly = {"class_path": "torch.optim.lr_scheduler.PolynomialLR", "init_args": {"total_iters": 500}}
    for section in (own, steps, poly, None):
        assert bind_time_budget(section, 80.0) == section


def test_validate_reports_bad_arguments_before_anything_loads(tmp_path, host):
    # Out-of-range values are recipe problems (rlpost validate, exit 2), not a failure once training starts.
    from rlpost.engine.recipe import RecipeError

    cfg = toy_recipe(str(tmp_path / "run"), max_steps=3, device="cpu")
    cfg["lr_scheduler"] = {"class_path": "rlpost.RunLengthLR", "init_args": {"warmup": 2.0, "over": "time"}}
    with pytest.raises(RecipeError) as info:
        validate(cfg, host)
    text = str(info.value)
    assert "lr_scheduler.init_args.warmup: must be a fraction of the run in [0, 1), got 2.0" in text
    assert "lr_scheduler.init_args.budget_s: over: time needs" in text
    assert not (tmp_path / "run").exists()


def test_every_rank_is_told_the_slowest_ranks_seconds():
    # Under `distributed` the work split's max_over_ranks is a collective; two fake ranks took 2 s and 5 s.
    from rlpost.engine.lr_schedule import end_step
    from rlpost.engine.sharding import GroupSharding

    _, scheduler = _scheduler(over="time", budget_s=10.0)
    shard = GroupSharding(0, rank=0, world_size=2, gather=lambda value: [value, 5.0])
    end_step(scheduler, 2.0, shard.max_over_ranks)
    assert scheduler.elapsed_s == 5.0


def test_the_runner_tells_the_sampler_the_runs_progress(tmp_path, host, monkeypatch):
    """Sampler.begin_run_step / end_run_step (a sampler schedule over the run, e.g. MixGRPO's shift_over): before
    each step its index and run.max_steps, after it the step's seconds (perf/step_sec), in order."""
    calls: list[tuple] = []
    monkeypatch.setattr(toy_components.ToyChainSampler, "begin_run_step", lambda self, s, n: calls.append(("b", s, n)))
    monkeypatch.setattr(toy_components.ToyChainSampler, "end_run_step", lambda self, sec: calls.append(("e", sec)))
    history = Runner(validate(toy_recipe(str(tmp_path / "run"), max_steps=3, device="cpu"), host), host).run()
    assert [c[:2] if c[0] == "b" else c[0] for c in calls] == [("b", 0), "e", ("b", 1), "e", ("b", 2), "e"]
    assert {c[2] for c in calls if c[0] == "b"} == {3}
    assert [c[1] for c in calls if c[0] == "e"] == [m["perf/step_sec"] for m in history]
