"""Exact resume: N steps == k steps + resume + (N-k) steps; resumes that cannot be honoured are errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rlpost.apps import cli
from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.checkpoint import CheckpointError, list_checkpoints
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def host() -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components,))


STEP_LR = {"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 2}}
# A schedule over the run's length: its progress on resume is a function of the restored step.
RUN_LENGTH_LR = {"class_path": "rlpost.RunLengthLR", "init_args": {"shape": "cosine", "warmup": 0.3}}


def _cfg(out: Path, steps: int, scheduler: dict = STEP_LR, **run):
    cfg = toy_recipe(str(out), max_steps=steps, **run)
    cfg["torch_optimizer"] = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}}
    cfg["lr_scheduler"] = scheduler
    cfg["checkpoint"] = {"every": 1, "keep_last": 3}
    cfg["ema"] = {"decay": 0.5}
    return cfg


def _snapshot(runner: Runner) -> dict:
    assert runner.backend is not None and runner.stream is not None and runner.ema is not None
    return {
        "weights": [p.detach().clone() for p in runner.backend.parameters],
        "ema": [s.clone() for s in runner.ema.shadow],
        "opt": runner.backend.optimizer.state_dict(),
        "sched": runner.backend.scheduler.state_dict() if runner.backend.scheduler else None,
        "rng": (runner.rollout_gen.get_state(), runner.minibatch_gen.get_state(), torch.get_rng_state()),
        "stream": runner.stream.state_dict(),
        "history": [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in runner.ctx.history],
    }


@pytest.mark.parametrize("scheduler", [STEP_LR, RUN_LENGTH_LR], ids=["StepLR", "RunLengthLR"])
def test_exact_resume_toy(tmp_path, host, scheduler):
    full = Runner(validate(_cfg(tmp_path / "full", 4, scheduler), host), host)
    full.run()
    a = _snapshot(full)
    if scheduler is STEP_LR:  # a 2-step run, extended by raising run.max_steps
        Runner(validate(_cfg(tmp_path / "part", 2, scheduler), host), host).run()
    else:  # a schedule over the run's length follows run.max_steps: the 4-step run, interrupted after step 2
        part = Runner(validate(_cfg(tmp_path / "part", 4, scheduler), host), host)
        part.begin()
        try:
            for _ in range(2):
                part.step()
                part.save_checkpoint()
        finally:
            part.finish("interrupted")
    resumed = Runner(validate(_cfg(tmp_path / "part", 4, scheduler), host), host, resume="latest")
    resumed.run()
    b = _snapshot(resumed)
    for x, y in zip(a["weights"] + a["ema"], b["weights"] + b["ema"], strict=True):
        assert torch.equal(x, y), "weights must be bitwise equal after resume"
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][name]), torch.as_tensor(sb[k][name])), name
    assert a["opt"]["param_groups"] == b["opt"]["param_groups"] and a["sched"] == b["sched"]
    for x, y in zip(a["rng"], b["rng"], strict=True):
        assert torch.equal(x, y)
    assert a["stream"] == b["stream"]
    assert a["history"] == b["history"], "rewards, losses and prompt order of every step must match"
    lines = (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    assert [c.step for c in list_checkpoints(tmp_path / "part")] == [2, 3, 4]
    assert json.loads((tmp_path / "part" / "resumes.jsonl").read_text())["step"] == 2


def test_resume_after_crash_truncates_later_metrics(tmp_path, host):
    Runner(validate(_cfg(tmp_path / "r", 2), host), host).run()
    with (tmp_path / "r" / "metrics.jsonl").open("a") as fh:  # a crashed step 3 logged before its checkpoint
        fh.write(json.dumps({"step": 3, "reward/toy-brightness": 0.1}) + "\n")
    Runner(validate(_cfg(tmp_path / "r", 3), host), host, resume=str(tmp_path / "r")).run()
    steps = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_resume_errors(tmp_path, host):
    with pytest.raises(CheckpointError, match="not found"):
        Runner(validate(_cfg(tmp_path / "x", 2), host), host, resume=str(tmp_path / "missing")).setup()
    with pytest.raises(CheckpointError, match="holds no run to resume"):
        Runner(validate(_cfg(tmp_path / "x", 2), host), host, resume="latest").setup()
    Runner(validate(_cfg(tmp_path / "r", 1), host), host).run()
    changed = _cfg(tmp_path / "r", 2)
    changed["model"] = {"class_path": "toy-policy", "init_args": {"scale": -0.5}}
    changed["sampler"] = {"class_path": "toy-chain", "init_args": {"num_steps": 3}}
    with pytest.raises(CheckpointError, match="model: changed"):
        Runner(validate(changed, host), host, resume="latest").setup()
    reseeded = _cfg(tmp_path / "r", 2, seed=7)
    with pytest.warns(UserWarning, match="run.seed changed from 0 to 7"):
        runner = Runner(validate(reseeded, host), host, resume="latest")
        runner.setup()
    assert runner.ctx.step == 1 and runner.seed == 0


def test_resume_cli_exit_codes(tmp_path, host, monkeypatch, capsys):
    import yaml

    monkeypatch.setattr(cli, "get_host", lambda: host)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_cfg(tmp_path / "run", 1)))
    assert cli.main(["train", "--recipe", str(recipe), "--resume", str(tmp_path / "nope")]) == 2
    assert "checkpoint path not found" in capsys.readouterr().err
    assert cli.main(["train", "--recipe", str(recipe), "--resume", "latest"]) == 2
    assert "holds no run to resume (no recipe.yaml): start it without --resume" in capsys.readouterr().err
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    assert cli.main(["train", "--recipe", str(recipe), "--model.scale", "0.5", "--resume", "latest"]) == 2
    assert "model: changed" in capsys.readouterr().err
    assert cli.main(["train", "--recipe", str(recipe), "--run.max_steps", "2", "--resume", "latest"]) == 0


def test_exact_resume_tiny_sd3_tree(tmp_path, tiny_sd3_dir):
    """Bitwise LoRA equality with the real tree sampler on the tiny SD3 (2 steps vs 1 + resume + 1)."""
    import yaml

    h = build_host()
    base = yaml.safe_load((ROOT / "recipes/tiny/treegrpo.yaml").read_text())
    base["model"]["init_args"]["pretrained"] = str(tiny_sd3_dir)
    base["sampler"]["init_args"].update({"k": 2, "depth": 1})
    base["run"].update({"groups_per_step": 1, "progress": False})
    base["checkpoint"] = {"every": 1}

    def run(out: str, steps: int, resume: str | None = None) -> Runner:
        cfg = json.loads(json.dumps(base))
        cfg["run"].update({"output_dir": out, "max_steps": steps})
        runner = Runner(validate(cfg, h), h, resume=resume)
        runner.run()
        return runner

    a = run(str(tmp_path / "a"), 2)
    run(str(tmp_path / "b"), 1)
    b = run(str(tmp_path / "b"), 2, resume="latest")
    assert a.backend is not None and b.backend is not None
    for x, y in zip(a.backend.parameters, b.backend.parameters, strict=True):
        assert torch.equal(x, y)
    assert (tmp_path / "b" / "checkpoints" / "step_000002" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert os.path.getsize(tmp_path / "b" / "checkpoints" / "step_000002" / "weights.safetensors") > 0
