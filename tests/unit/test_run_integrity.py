"""Run-directory integrity: a failed start does not lock its directory, ``export`` verifies checksums, a manifest
without its file list is corrupt, and a torn last line of ``metrics.jsonl`` is repaired on resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from rlpost.apps import cli
from rlpost.apps.export import export_run
from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.checkpoint import CheckpointError, find_checkpoint, read_checkpoint, write_checkpoint
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe


@pytest.fixture
def host() -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components,))


def _cfg(out: Path, steps: int) -> dict:
    cfg = toy_recipe(str(out), max_steps=steps)
    cfg["checkpoint"] = {"every": 1, "keep_last": 2}
    return cfg


# ------------------------------------------------------------------------------------------- failed start (5)


def test_failed_start_does_not_lock_its_run_directory(tmp_path, host, monkeypatch, capsys):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_cfg(tmp_path / "run", 1)))

    def broken(self, device):
        raise OSError("weights could not be loaded")

    with monkeypatch.context() as m:
        m.setattr(toy_components.ToyPolicy, "setup", broken)
        with pytest.raises(OSError, match="could not be loaded"):
            cli.main(["train", "--recipe", str(recipe)])
    assert (tmp_path / "run" / "recipe.yaml").is_file()  # the failed start wrote its recipe ...
    assert cli.main(["train", "--recipe", str(recipe), "--resume", "latest"]) == 2
    assert "start it again without --resume" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="never trained"):
        assert cli.main(["train", "--recipe", str(recipe)]) == 0  # ... but the retry may reuse the directory
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_run_that_trained_is_never_overwritten(tmp_path, host, monkeypatch, capsys):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    cfg = _cfg(tmp_path / "run", 1)
    cfg["checkpoint"] = {"every": 0, "at_end": False}  # metrics but no checkpoint: still a run that trained
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    assert cli.main(["train", "--recipe", str(recipe)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- integrity (7)


def _weights() -> dict[str, torch.Tensor]:
    return {"trainable.0000": torch.ones(2, 3)}


def _write_lora(directory: Path) -> None:
    (directory / "lora").mkdir()
    save_file({"lora_A.weight": torch.ones(4, 2)}, str(directory / "lora" / "pytorch_lora_weights.safetensors"))


def test_export_refuses_a_corrupt_lora(tmp_path, capsys):
    run = tmp_path / "run"
    ckpt = write_checkpoint(run, 1, _weights(), {"step": 1}, extra=_write_lora, manifest_extra={"step": 1})
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
    ckpt = write_checkpoint(run, 1, _weights(), {"step": 1}, extra=_write_lora)
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
