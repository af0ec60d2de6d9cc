"""Validation checks the inputs a run needs (devices, datasets, model configs) cheaply, and ``train`` refuses a bad
recipe with exit code 2 before it writes or loads anything. The one-fixture-per-case checks of malformed recipes are
in tests/unit/test_recipe.py (tests/fixtures/recipes/bad/)."""

from __future__ import annotations

import pytest
import torch
import yaml

from rlpost.apps import cli
from rlpost.apps.host import build_host
from rlpost.components.hub_prompts import HFDatasetPrompts
from rlpost.components.prompt_sources import PromptFile
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import device_problem
from rlpost.models.adapter_settings import LoraSpec
from rlpost.models.sd3 import SD3Policy
from tests import toy_components
from tests.argument_checks import problems_of
from tests.toy_components import toy_recipe
from tests.weights_standins import write_sd3_standin


@pytest.fixture
def host() -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components,))


# ------------------------------------------------------------------------------------------------- devices


def test_devices_are_checked_against_this_host(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a host with two CUDA devices
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_problem("cuda") is None and device_problem("cuda:1") is None
    assert "this host has 2 CUDA device(s) (cuda:0..1)" in str(device_problem("cuda:3"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU host
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert "no CUDA device on this host" in str(device_problem("cuda"))
    assert device_problem("auto") is None and device_problem("cpu") is None
    assert "is not a device" in str(device_problem("tpu"))
    assert "not 'meta'" in str(device_problem("meta"))


@pytest.mark.parametrize(
    ("run", "field"),
    [({"device": "cuda:99"}, "run.device"), ({"seed": 2**40}, "run.seed"), ({"max_grad_norm": float("inf")}, None)],
)
def test_train_refuses_before_writing_anything(tmp_path, host, monkeypatch, capsys, run, field):
    monkeypatch.setattr(cli, "get_host", lambda: host)
    cfg = toy_recipe(str(tmp_path / "run"), **run)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--recipe", str(recipe)]) == 2
    assert f"{field or 'run.max_grad_norm'}:" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------- model configs


def test_sd3_validate_reads_resolution_limits_from_the_model_configs(tmp_path):
    model = write_sd3_standin(tmp_path / "m", vae_blocks=2, patch_size=2, pos_embed_max_size=8)  # factor 4, <= 32
    assert SD3Policy(str(model), resolution=32).validate(None) == []
    assert SD3Policy(str(model), resolution=30).validate(None) == [
        "model.init_args.resolution: 30 is not a multiple of 4 (VAE factor 2 x patch size 2)"
    ]
    problems = SD3Policy(str(model), resolution=64).validate(None)
    assert problems and "64 is too large for this model: at most 32" in problems[0]


def test_lora_ranges_name_their_fields():
    spec = LoraSpec(rank=0, alpha=0, dropout=1.0, target_modules=[])
    assert spec.problems("model.init_args.lora") == [
        "model.init_args.lora.rank: must be >= 1, got 0",
        "model.init_args.lora.alpha: must be positive, got 0",
        "model.init_args.lora.dropout: must be in [0, 1), got 1.0",
        "model.init_args.lora.target_modules: must name at least one module",
    ]
    assert LoraSpec().problems("x") == []


# -------------------------------------------------------------------------------------------------- prompts


def test_save_to_disk_dataset_directory_is_a_prompt_source(tmp_path):
    import datasets

    rows = {"prompt": ["a red apple", "a blue car"], "score": [1, 2]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "dd"))
    source = HFDatasetPrompts(str(tmp_path / "ds"))
    assert source.validate(None) == []
    assert source.load() == [("a red apple", {"score": 1}), ("a blue car", {"score": 2})]
    by_split = HFDatasetPrompts(str(tmp_path / "dd"), split="test", limit=1)
    assert by_split.validate(None) == [] and by_split.load() == [("a red apple", {"score": 1})]
    assert "has no split 'train' (splits: ['test'])" in HFDatasetPrompts(str(tmp_path / "dd")).validate(None)[0]
    wrong = HFDatasetPrompts(str(tmp_path / "ds"), column="caption").validate(None)
    assert wrong == [f"prompts.init_args.column: dataset {str(tmp_path / 'ds')!r} has no column 'caption' "
                     "(columns: ['prompt', 'score'])"]  # fmt: skip


def test_dataset_file_columns_are_read_without_loading_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"caption": ["a red apple"]}), tmp_path / "p.parquet")
    (tmp_path / "p.jsonl").write_text('{"text": "a red apple"}\n')
    for builder, name, column in (("parquet", "p.parquet", "caption"), ("json", "p.jsonl", "text")):
        f = str(tmp_path / name)
        assert HFDatasetPrompts(builder, data_files=f, column=column).validate(None) == []
        assert "has no column 'prompt'" in HFDatasetPrompts(builder, data_files=f).validate(None)[0]
    missing = HFDatasetPrompts("csv", data_files=str(tmp_path / "nope.csv")).validate(None)
    assert missing == [f"prompts.init_args.data_files: file not found: {tmp_path / 'nope.csv'}"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("p.csv", "caption\na red apple\n", "no column 'prompt' in the header"),
        ("p.json", '["a red apple", "  "]', "p.json[1]: blank prompt"),
        ("p.json", '["a red apple",', "malformed JSON"),
        ("p.jsonl", '{"prompt": "a"}\n[1, 2]\n', "p.jsonl:2: expected an object"),
    ],
)
def test_prompt_file_problems_name_file_and_record(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    problems = PromptFile(str(tmp_path / name)).validate(None)
    assert len(problems) == 1 and problems[0].startswith("prompts.init_args.path: ") and message in problems[0]


def test_prompt_file_limit_must_be_positive(tmp_path):
    (tmp_path / "p.txt").write_text("a red apple\n")
    assert problems_of(PromptFile, "prompts", path=str(tmp_path / "p.txt"), limit=0) == [
        "prompts.init_args.limit: must be >= 1, got 0"
    ]
    assert PromptFile(str(tmp_path / "p.txt"), limit=1).validate(None) == []


def test_rewards_name_their_missing_checkpoint(tmp_path, monkeypatch):
    from rlpost_rewards.hps import HPSv2Reward

    monkeypatch.delenv("RLPOST_MODELS", raising=False)
    reward = HPSv2Reward()

    class _Recipe:
        rewards = [reward]

    problems = reward.validate(_Recipe())
    assert len(problems) == 1 and problems[0].startswith("rewards[0].init_args.checkpoint: hps-v2.1:")
    assert "RLPOST_MODELS is not set" in problems[0]
    (tmp_path / "HPS_v2.1_compressed.pt").write_bytes(b"")
    monkeypatch.setenv("RLPOST_MODELS", str(tmp_path))
    assert reward.validate(_Recipe()) == []
