"""Run-directory integrity: a failed start does not lock its directory, ``export`` verifies checksums, a manifest
without its file list is corrupt, and a torn last line of ``metrics.jsonl`` is repaired on resume."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from rlpost import hookimpl
from rlpost.apps import cli
from rlpost.apps.export import export_run
from rlpost.apps.host import build_host
from rlpost.core.plugin_errors import PluginRuntimeError
from rlpost.core.plugins import PluginHost
from rlpost.engine.checkpoint import CheckpointError, find_checkpoint, read_checkpoint, write_checkpoint
from rlpost.engine.recipe import validate
from rlpost.engine.rundir import RunDirectory
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def host() -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components,))


def _cfg(out: Path, steps: int) -> dict:
    cfg = toy_recipe(str(out), max_steps=steps)
    cfg["checkpoint"] = {"every": 1, "keep_last": 2}
    return cfg


# ------------------------------------------------------------------------------------------- failed start (5)


def _broken_start(tmp_path: Path, monkeypatch, capsys) -> Path:
    """A start whose model cannot load its weights: exit 2 with one line naming the problem, no traceback."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_cfg(tmp_path / "run", 1)))

    def broken(self, device):
        raise OSError("/models/x/transformer/diffusion_pytorch_model.safetensors: weights could not be loaded")

    with monkeypatch.context() as m:
        m.setattr(toy_components.ToyPolicy, "setup", broken)
        assert cli.main(["train", "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "diffusion_pytorch_model.safetensors: weights could not be loaded" in err and "Traceback" not in err
    assert (tmp_path / "run" / "recipe.yaml").is_file()  # the failed start wrote its recipe ...
    return recipe


def test_failed_start_does_not_lock_its_run_directory(tmp_path, host, monkeypatch, capsys):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    recipe = _broken_start(tmp_path, monkeypatch, capsys)
    with pytest.warns(UserWarning, match="never completed a step"):
        assert cli.main(["train", "--recipe", str(recipe)]) == 0  # ... but the retry may reuse the directory
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_resume_latest_restarts_a_run_that_failed_before_its_first_checkpoint(tmp_path, host, monkeypatch, capsys):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    recipe = _broken_start(tmp_path, monkeypatch, capsys)
    with pytest.warns(UserWarning, match="never completed a step"):
        assert cli.main(["train", "--recipe", str(recipe), "--resume", "latest"]) == 0
    run = tmp_path / "run"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()] == [
        {"step": 0, "checkpoint": None, "restart": True}
    ]


def test_a_run_that_trained_is_never_overwritten(tmp_path, host, monkeypatch, capsys):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    cfg = _cfg(tmp_path / "run", 1)
    cfg["checkpoint"] = {"every": 0, "at_end": False}  # metrics but no checkpoint: still a run that trained
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert cli.main(["train", "--recipe", str(recipe)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    # A completed run without a checkpoint cannot be continued, and is not restarted over either.
    assert cli.main(["train", "--recipe", str(recipe), "--resume", "latest"]) == 2
    assert "completed without saving a checkpoint" in capsys.readouterr().err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


def test_unwritable_output_dir_is_named_in_one_line(tmp_path, host, monkeypatch, capsys):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    (tmp_path / "a-file").write_text("not a directory")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_cfg(tmp_path / "a-file" / "run", 1)))
    assert cli.main(["train", "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"run.output_dir {tmp_path / 'a-file' / 'run'}: cannot write the run directory" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("weights", "damage"),
    [("transformer/diffusion_pytorch_model.safetensors", "garbage"), ("text_encoder/model.safetensors", "truncated")],
)
def test_corrupt_model_weights_are_named_and_do_not_block_a_rerun(
    tmp_path, host, monkeypatch, capsys, tiny_sd3_dir, weights, damage
):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    model = tmp_path / "model"
    shutil.copytree(tiny_sd3_dir, model, copy_function=os.symlink)
    broken = model / weights
    data = broken.read_bytes()
    broken.unlink()  # a file of its own, not the shared fixture's
    broken.write_bytes(b"garbage!" * 64 if damage == "garbage" else data[: len(data) // 2])
    cfg = _cfg(tmp_path / "run", 1)
    cfg["model"] = {
        "class_path": "sd3",
        "init_args": {"pretrained": str(model), "dtype": "float32", "resolution": 32, "max_sequence_length": 32},
    }
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert str(broken) in err and "Traceback" not in err
    assert RunDirectory(tmp_path / "run").trained() == []  # nothing there blocks the rerun once the model is fixed


def test_resume_names_a_corrupt_or_missing_recipe_yaml(tmp_path, host, monkeypatch, capsys):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_cfg(tmp_path / "run", 1)))
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    stored = tmp_path / "run" / "recipe.yaml"
    for text, why in (
        ("run: [unclosed\n", "not a readable YAML recipe"),
        ("run: {}\nrun: {}\n", "not a readable YAML recipe (duplicate key 'run'"),  # the YAML limits apply
        ("- a list\n", "not a recipe (expected a YAML mapping, got list)"),
    ):
        stored.write_text(text)
        assert cli.main(["train", "--recipe", str(recipe), "--resume", "latest"]) == 2
        err = capsys.readouterr().err
        assert f"{stored}: {why}" in err and "Traceback" not in err
    stored.unlink()
    assert cli.main(["train", "--recipe", str(recipe), "--resume", "latest"]) == 2
    assert f"{stored} not found" in capsys.readouterr().err


# A training process that stops at a given step until it is killed: the hook writes the marker file the test waits
# for, so the kill lands at a known point without any timing assumption.
_PAUSING_RUN = """
import json, sys, threading
from pathlib import Path
from rlpost import hookimpl
from rlpost.apps.host import build_host
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components

cfg, marker, pause_at = json.loads(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])


class Pause:
    @hookimpl
    def rlpost_after_rollout(self, run, rollout):
        if run.step == pause_at:
            marker.write_text("paused")
            threading.Event().wait(600)  # until SIGKILL


host = build_host(load_entrypoints=False, extra_plugins=(toy_components, Pause()))
Runner(validate(cfg, host), host).run()
"""


def _kill_during_step(cfg: dict, step: int, tmp_path: Path) -> None:
    """Run ``cfg`` in a child process and SIGKILL it while it samples step ``step + 1`` (no cleanup runs)."""
    marker = tmp_path / f"paused-{step}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", _PAUSING_RUN, json.dumps(cfg), str(marker), str(step)], env=env, cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 300  # a generous bound for a cold start on a loaded machine
        while not marker.exists():
            assert child.poll() is None, f"the child exited ({child.returncode}) before it paused"
            assert time.monotonic() < deadline, "the child never reached the pause"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL


def _eval_cfg(out: Path, steps: int) -> dict:
    cfg = _cfg(out, steps)
    cfg["checkpoint"] = {"every": 0}  # at the end only: the kill comes before the first checkpoint
    cfg["eval"] = {
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": ["held out"]}},
        "num_steps": 2,
        "every": 1,
        "batch_size": 1,
    }
    return cfg


def _untimed(run: Path, name: str) -> list[dict]:
    lines = [json.loads(x) for x in (run / name).read_text().splitlines()]
    return [{k: v for k, v in r.items() if "_sec" not in k and not k.startswith("perf/")} for r in lines]


def test_a_run_killed_before_its_first_step_completed_reruns(tmp_path, host, monkeypatch):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    cfg = _eval_cfg(tmp_path / "run", 3)
    _kill_during_step(cfg, 0, tmp_path)  # after the "before" evaluation, while sampling step 1
    run = tmp_path / "run"
    assert [r["step"] for r in _untimed(run, "eval.jsonl")] == [0] and not (run / "summary.json").exists()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    with pytest.warns(UserWarning, match="never completed a step"):  # the identical rerun takes the directory over
        assert cli.main(["train", "--recipe", str(recipe)]) == 0
    Runner(validate(_eval_cfg(tmp_path / "whole", 3), host), host).run()
    for name in ("metrics.jsonl", "eval.jsonl"):  # as if it had never been killed: step 0 is not logged twice
        assert _untimed(run, name) == _untimed(tmp_path / "whole", name)


class _Killed(BaseException):
    """Stands in for SIGKILL in-process; the summary ``finish`` writes on the way out is then removed (a killed
    process writes none), leaving what a kill during step 3 leaves."""


def test_a_run_killed_after_logged_steps_restarts_from_step_0(tmp_path, host, monkeypatch, capsys):
    class Kill:
        @hookimpl
        def rlpost_after_rollout(self, run, rollout):
            if run.step == 2:
                raise _Killed

    monkeypatch.setattr(cli, "get_host", lambda: host)
    cfg = _eval_cfg(tmp_path / "run", 3)
    killing = build_host(load_entrypoints=False, extra_plugins=(toy_components, Kill()))
    with pytest.raises(_Killed):
        Runner(validate(cfg, killing), killing).run()
    run = tmp_path / "run"
    (run / "summary.json").unlink()
    assert [r["step"] for r in _untimed(run, "metrics.jsonl")] == [1, 2]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    # Logged steps are never overwritten by a new run; --resume latest restarts the run, as the refusal says.
    assert cli.main(["train", "--recipe", str(recipe)]) == 2
    assert "--resume latest starts it again from step 0" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="restarting the run from step 0"):
        assert cli.main(["train", "--recipe", str(recipe), "--resume", "latest"]) == 0
    Runner(validate(_eval_cfg(tmp_path / "whole", 3), host), host).run()
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert _untimed(run, name) == _untimed(tmp_path / "whole", name)


def test_a_restart_hides_the_dropped_attempt_from_tensorboard(tmp_path, host):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Fail:
        @hookimpl
        def rlpost_after_step(self, run, metrics):
            if run.step == 2:
                raise RuntimeError("tracker went away")

    cfg = _eval_cfg(tmp_path / "run", 3)
    cfg["logging"] = {"tensorboard": True}
    failing = build_host(load_entrypoints=False, extra_plugins=(toy_components, Fail()))
    with pytest.raises(PluginRuntimeError):
        Runner(validate(cfg, failing), failing).run()
    with pytest.warns(UserWarning, match="restarting the run from step 0"):
        Runner(validate(cfg, host), host, resume="latest").run()
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/weighted")] == [1, 2, 3]  # each step once
    assert [e.step for e in acc.Scalars("eval/toy-brightness")] == [0, 1, 2, 3]


def test_damaged_checkpoints_are_neither_overwritten_nor_restarted_over(tmp_path, host, monkeypatch, capsys):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_cfg(tmp_path / "run", 1)))
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    (ckpt,) = (tmp_path / "run" / "checkpoints").glob("step_*")
    (ckpt / "manifest.json").unlink()
    assert cli.main(["train", "--recipe", str(recipe)]) == 2
    assert "refusing to overwrite it; its checkpoints lack a readable manifest.json" in capsys.readouterr().err
    assert cli.main(["train", "--recipe", str(recipe), "--resume", "latest"]) == 2
    assert "step_000001 lack a readable manifest.json (damaged); repair them, or remove them" in capsys.readouterr().err
    assert (ckpt / "weights.safetensors").is_file()


# ----------------------------------------------------------------------------------------------- integrity (7)


def _weights() -> dict[str, torch.Tensor]:
    return {"trainable.0000": torch.ones(2, 3)}


def _write_lora(directory: Path) -> None:
    (directory / "lora").mkdir()
    save_file({"lora_A.weight": torch.ones(4, 2)}, str(directory / "lora" / "pytorch_lora_weights.safetensors"))


def _lora_run(run: Path) -> Path:
    """A run directory (its recipe.yaml) with one checkpoint holding a LoRA; returns the checkpoint."""
    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump(toy_recipe(str(run))))
    return write_checkpoint(run, 1, _weights(), {"step": 1}, extra=_write_lora, manifest_extra={"step": 1})


def test_export_refuses_a_corrupt_lora(tmp_path, capsys):
    run = tmp_path / "run"
    ckpt = _lora_run(run)
    assert export_run(run, tmp_path / "good") == tmp_path / "good"  # an intact checkpoint exports
    lora = ckpt / "lora" / "pytorch_lora_weights.safetensors"
    data = bytearray(lora.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the tensor payload: still a loadable safetensors file
    lora.write_bytes(bytes(data))
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "out")]) == 2
    assert "lora/pytorch_lora_weights.safetensors does not match its sha256" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_refuses_files_the_manifest_does_not_list(tmp_path):
    run = tmp_path / "run"
    ckpt = _lora_run(run)
    (ckpt / "lora" / "extra.safetensors").write_bytes(b"not verified")
    with pytest.raises(CheckpointError, match="not in the manifest"):
        export_run(run, tmp_path / "out")


@pytest.mark.parametrize("files", ["missing", {}, ["weights.safetensors"], {"weights.safetensors": 3}])
def test_manifest_without_a_file_list_is_corrupt(tmp_path, files):
    ckpt = write_checkpoint(tmp_path, 1, _weights(), {"step": 1})
    manifest = json.loads((ckpt / "manifest.json").read_text())
    if files == "missing":
        del manifest["files"]
    else:
        manifest["files"] = files
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="corrupt manifest"):
        read_checkpoint(find_checkpoint("latest", tmp_path))


def test_manifest_cannot_point_outside_the_checkpoint(tmp_path):
    ckpt = write_checkpoint(tmp_path, 1, _weights(), {"step": 1})
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["../../outside"] = "0" * 64
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        read_checkpoint(find_checkpoint("latest", tmp_path))


def _rehash(ckpt: Path, name: str, text: str) -> None:
    """Replace a checkpoint file and update its sha256 in the manifest, so the integrity check passes."""
    (ckpt / name).write_text(text)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256(text.encode()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ("{}", "not a run state (step: missing; prompt_stream: missing; rng: missing; components: missing"),
        (
            '{"step": 1, "prompt_stream": {}, "rng": [], "components": {}, "plugins": {}}',
            "rng: expected dict, got list",
        ),
        ('{"__tensor__": "nope"}', "malformed state tree (KeyError"),
        ("STEP", "step: 5, but manifest.json says 1"),
        ("RNG", "rng.rollout: expected Tensor, got tuple"),
        ("PROMPTS", "prompt_stream cannot be restored (ValueError: invalid literal for int()"),
    ],
)
def test_a_rehashed_state_json_that_is_no_run_state_is_named(tmp_path, host, monkeypatch, capsys, text, why):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_cfg(tmp_path / "run", 1)))
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    (ckpt,) = (tmp_path / "run" / "checkpoints").glob("step_*")
    state = json.loads((ckpt / "state.json").read_text())
    edits = {  # a valid JSON state with one part edited
        "STEP": {"step": 5},
        "RNG": {"rng": {**state["rng"], "rollout": state["rng"]["python"]}},
        "PROMPTS": {"prompt_stream": {**state["prompt_stream"], "epoch": "first"}},
    }
    if text in edits:
        text = json.dumps({**state, **edits[text]})
    _rehash(ckpt, "state.json", text)
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert cli.main(["train", "--recipe", str(recipe), "--run.max_steps", "2", "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert f"{ckpt / 'state.json'}: " in err and why in err and "Traceback" not in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # nothing was changed


@pytest.mark.parametrize("torn", ['{"step": 3, "reward/toy-bri', '{"step": 3, "reward', "\x00\x00\x00"])
def test_torn_last_metrics_line_is_repaired_on_resume(tmp_path, host, torn):
    Runner(validate(_cfg(tmp_path / "r", 2), host), host).run()
    with (tmp_path / "r" / "metrics.jsonl").open("a") as fh:  # crash (or full disk) in the middle of an append
        fh.write(torn)
    runner = Runner(validate(_cfg(tmp_path / "r", 3), host), host, resume="latest")
    with pytest.warns(UserWarning, match="torn last line"):
        runner.run()
    steps = [json.loads(x)["step"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert len(runner.ctx.history) == 3


def test_corrupt_metrics_line_before_the_last_is_an_error(tmp_path, host):
    Runner(validate(_cfg(tmp_path / "r", 2), host), host).run()
    path = tmp_path / "r" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0][:10] + "\n" + lines[1] + "\n")
    with pytest.raises(CheckpointError, match=r"metrics.jsonl:1: corrupt line"):
        Runner(validate(_cfg(tmp_path / "r", 3), host), host, resume="latest").run()
