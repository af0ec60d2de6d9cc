"""Export and inference on the tiny SD3: the exported LoRA loads with ``StableDiffusion3Pipeline.load_lora_weights``
into a fresh pipeline and reproduces the run's held-out samples; ``rlpost sample`` reproduces them too; the exported
model card parses with ``huggingface_hub.ModelCard.load`` and names the base model the run really loaded."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from PIL import Image

from rlpost.apps import cli
from rlpost.apps.export import _model_card
from rlpost.apps.host import build_host
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.tolerances import assert_pixels_close

PROMPTS = ["a red cube", "a blue sphere"]
HUB_ID = "rlpost-tests/tiny-sd3"
_find_spec = importlib.util.find_spec


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory, tiny_sd3_dir):
    """The tiny SD3 laid out as a Hugging Face cache snapshot of ``HUB_ID`` (``models--org--name/snapshots/<rev>``,
    its files symlinks, as ``huggingface_hub`` stores them), with the base model's own card carrying a license."""
    snapshot = tmp_path_factory.mktemp("hub") / "models--rlpost-tests--tiny-sd3" / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_sd3_dir, snapshot, copy_function=os.symlink)
    card = "---\nlicense: other\nlicense_name: tiny-terms\nlicense_link: LICENSE.md\n---\n"
    (snapshot / "README.md").write_text(card)
    return snapshot


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, snapshot_dir):
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    out = tmp_path_factory.mktemp("export") / "run"
    cfg = {
        "run": {"seed": 0, "output_dir": str(out), "max_steps": 2, "groups_per_step": 1, "samples_per_group": 2,
                "device": "cpu", "progress": False},
        "model": {"class_path": "sd3", "init_args": {"pretrained": str(snapshot_dir), "dtype": "float32",
                  "resolution": 32, "guidance_scale": 1.0, "max_sequence_length": 32, "lora": {"rank": 4, "alpha": 8}}},
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": ["a green cone", "a yellow star"]}},
        "sampler": {"class_path": "toy-chain", "init_args": {"num_steps": 2}},
        "rewards": [{"class_path": "toy-brightness"}],
        "advantage": {"class_path": "toy-group"},
        "optimizer": {"class_path": "clipped-surrogate", "init_args": {"clip_range": 1.0, "minibatch_edges": 4}},
        "torch_optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}},
        "eval": {"prompts": {"class_path": "prompt-list", "init_args": {"prompts": PROMPTS}}, "num_steps": 3,
                 "seed": 5, "batch_size": 1},
        "checkpoint": {"every": 1, "keep_last": 1},
    }  # fmt: skip
    runner = Runner(validate(cfg, host), host)
    runner.run()
    return out, host


def _eval_images(run, step: int) -> list[np.ndarray]:
    return [np.asarray(Image.open(run / "eval" / f"step_{step:06d}" / f"{i:04d}.png")) for i in range(len(PROMPTS))]


def test_exported_lora_loads_into_fresh_pipeline_and_reproduces_eval(lora_run, tiny_sd3_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    run, _ = lora_run
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "export")]) == 0
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "export"))
    trained, before = _eval_images(run, 2), _eval_images(run, 0)
    assert any(not np.array_equal(a, b) for a, b in zip(trained, before, strict=True)), "training must change images"
    for i, prompt in enumerate(PROMPTS):
        image = pipe(
            prompt, num_inference_steps=3, guidance_scale=1.0, height=32, width=32, max_sequence_length=32,
            generator=torch.Generator().manual_seed(5 + i), output_type="np",
        ).images[0]  # fmt: skip
        got = (image * 255).round().astype(np.uint8)
        assert np.abs(got.astype(int) - trained[i].astype(int)).max() <= 1, f"prompt {i} differs from the run's eval"


def test_exported_card_parses_and_names_base_model_license_tags_and_recipe(lora_run, tmp_path):
    run, _ = lora_run
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "export")]) == 0
    card = ModelCard.load(tmp_path / "export" / "README.md")  # what the Hub and diffusers read
    data = card.data
    # The run loaded a cache snapshot: the card names the Hub model, not the snapshot's path.
    assert data.base_model == HUB_ID and data.base_model_relation == "adapter"
    assert data.pipeline_tag == "text-to-image" and data.library_name == "diffusers"
    algorithm = "tests.toy_components"  # the plugin that registered the sampler
    assert data.tags == ["text-to-image", "diffusers", "lora", "rlpost", "rl-post-training", "sd3", algorithm]
    # The license is the base model's own, read offline from the snapshot's card.
    assert (data.license, data.license_name) == ("other", "tiny-terms")
    assert data.license_link == f"https://huggingface.co/{HUB_ID}/blob/main/LICENSE.md"
    assert f'DiffusionPipeline.from_pretrained("{HUB_ID}")' in card.text
    assert "sampler=toy-chain" in card.text and "toy-brightness" in card.text and "| 2 |" in card.text
    # The resolved recipe, verbatim in a YAML code block: it parses back to the run's recipe.yaml.
    block = card.text.split("## Recipe", 1)[1].split("```yaml\n", 1)[1].split("\n```", 1)[0]
    assert yaml.safe_load(block) == yaml.safe_load((run / "recipe.yaml").read_text())
    assert yaml.safe_load(block)["model"]["init_args"]["lora"]["rank"] == 4
    # `rlpost export --license` sets the card's license.
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "e2"), "--license", "apache-2.0"]) == 0
    assert ModelCard.load(tmp_path / "e2" / "README.md").data.license == "apache-2.0"


def test_export_is_world_readable_and_its_card_shows_the_sampling_settings(lora_run, tmp_path):
    run, _ = lora_run
    weights = next((run / "checkpoints").glob("step_*/lora/*.safetensors"))
    assert stat.S_IMODE(weights.stat().st_mode) == 0o600  # checkpoints stay owner-only
    old = os.umask(0o022)
    try:
        assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "export")]) == 0
    finally:
        os.umask(old)
    for path in (tmp_path / "export").rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    text = ModelCard.load(tmp_path / "export" / "README.md").text
    # eval.num_steps, the model's guidance scale, resolution and text length: the settings the run evaluated with.
    call = "pipe(prompt, num_inference_steps=3, guidance_scale=1.0, height=32, width=32, max_sequence_length=32)"
    assert f"image = {call}.images[0]" in text


class _FakeHub:
    """huggingface_hub.HfApi stand-in recording the calls (the HTTP boundary is not crossed in tests)."""

    calls: list = []

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs, sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())))
        return f"https://huggingface.co/{kwargs['repo_id']}/commit/0123"


def test_export_pushes_to_the_hub_through_huggingface_hub(lora_run, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    run, _ = lora_run
    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeHub)
    _FakeHub.calls = []
    out = tmp_path / "export"
    args = ["export", "--run", str(run), "--out", str(out), "--push_to_hub", "me/tiny-lora", "--private"]
    assert cli.main(args) == 0
    assert _FakeHub.calls == [
        ("init", None),
        ("create_repo", "me/tiny-lora", {"repo_type": "model", "private": True, "exist_ok": True}),
        (
            "upload_folder",
            {"repo_id": "me/tiny-lora", "repo_type": "model", "folder_path": str(out),
             "commit_message": "Upload export (rlpost export)"},
            ["README.md", "pytorch_lora_weights.safetensors"],
        ),
    ]  # fmt: skip
    assert "pushed to https://huggingface.co/me/tiny-lora/commit/0123" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["export", "--run", str(run), "--out", str(out), "--push_to_hub", "not a repo"])
    assert exit_.value.code == 2 and "'not a repo' is not a Hugging Face Hub id" in capsys.readouterr().err


def test_sample_cli_reproduces_eval(lora_run, tmp_path, monkeypatch):
    run, host = lora_run
    monkeypatch.setattr(cli, "get_host", lambda: host)
    args = ["sample", "--run", str(run), "--out", str(tmp_path / "s"), "--num-steps", "3", "--seed", "5"]
    assert cli.main([*args, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]) == 0
    for i, expected in enumerate(_eval_images(run, 2)):
        # Same noise and sigmas through another entry point: at most one level apart after rounding (fp32 kernels).
        assert_pixels_close(np.asarray(Image.open(tmp_path / "s" / f"{i:04d}.png")), expected)
    assert cli.main(["export", "--run", str(tmp_path / "nowhere"), "--out", str(tmp_path / "e")]) == 2


def test_sample_does_not_revalidate_trackers_or_the_training_device(lora_run, tmp_path, monkeypatch):
    # A run trained on a GPU host with TensorBoard and W&B samples on a host with neither.
    run, host = lora_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    stored = yaml.safe_load((copy / "recipe.yaml").read_text())
    stored["logging"] = {**stored.get("logging", {}), "tensorboard": True, "wandb": True}
    stored["run"]["device"] = "cuda:4096"
    (copy / "recipe.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else
                        _find_spec(name, *a))  # fmt: skip
    monkeypatch.setattr(cli, "get_host", lambda: host)
    args = ["sample", "--run", str(copy), "--out", str(tmp_path / "s"), "--num-steps", "2", "--device", "cpu"]
    assert cli.main([*args, "--prompt", PROMPTS[0]]) == 0
    assert (tmp_path / "s" / "0000.png").is_file()


MANIFEST = {
    "step": 7,
    "components": {"model": "sd3", "sampler": "tree", "advantage": "tree-backup", "optimizer": "clipped-surrogate"},
    "origins": {"sampler": "treegrpo", "advantage": "treegrpo"},
    "rewards": ["pickscore"],
    "ema": False,
}


def _card(tmp_path, base, kind="lora", license=None) -> ModelCard:
    path = tmp_path / "README.md"
    _model_card({**MANIFEST, "base_model": base}, tmp_path / "run", kind, license).save(path)
    return ModelCard.load(path)  # read back the way the Hub and diffusers read it


def test_model_card_metadata_for_a_hub_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # the base model's card is not cached
    card = _card(tmp_path, "stabilityai/stable-diffusion-3.5-medium")
    data = card.data
    assert data.base_model == "stabilityai/stable-diffusion-3.5-medium" and data.base_model_relation == "adapter"
    assert data.pipeline_tag == "text-to-image" and data.library_name == "diffusers"
    assert data.tags == ["text-to-image", "diffusers", "lora", "rlpost", "rl-post-training", "sd3", "treegrpo"]
    assert data.license == "other" and "huggingface.co/stabilityai/stable-diffusion-3.5-medium" in card.text
    assert "**Algorithm:** treegrpo" in card.text and "**Training steps:** 7" in card.text


def test_model_card_resolves_a_cache_snapshot_and_inherits_the_base_license(tmp_path):
    snapshot = tmp_path / "hub" / "models--stabilityai--stable-diffusion-3.5-medium" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text(
        "---\nlicense: other\nlicense_name: stabilityai-ai-community\nlicense_link: LICENSE.md\n---\n# SD3.5\n"
    )
    card = _card(tmp_path, str(snapshot), kind="transformer")
    data = card.data
    assert data.base_model == "stabilityai/stable-diffusion-3.5-medium" and data.base_model_relation == "finetune"
    assert "lora" not in data.tags
    assert data.license == "other" and data.license_name == "stabilityai-ai-community"
    assert data.license_link == "https://huggingface.co/stabilityai/stable-diffusion-3.5-medium/blob/main/LICENSE.md"
    # An explicit license wins over the base model's.
    assert _card(tmp_path, str(snapshot), license="apache-2.0").data.license == "apache-2.0"


def test_model_card_local_base_and_no_base(tmp_path):
    local = tmp_path / "my-sd3"
    local.mkdir()
    (local / "README.md").write_text("---\nlicense: mit\n---\n")
    card = _card(tmp_path, str(local))
    # A local base is no Hub id: the metadata (which the Hub links) leaves it out; the text names the path.
    assert card.data.base_model is None and card.data.license == "mit"
    assert f'DiffusionPipeline.from_pretrained("{local.resolve()}")' in card.text
    # Its Hub id, given at export or recorded by diffusers in model_index.json, is the card's base_model.
    named = _model_card({**MANIFEST, "base_model": str(local)}, tmp_path / "run", "lora", base_model="org/sd3")
    assert named.data.base_model == "org/sd3" and named.data.base_model_relation == "adapter"
    (local / "model_index.json").write_text(json.dumps({"_class_name": "X", "_name_or_path": "org/saved-from"}))
    assert _card(tmp_path, str(local)).data.base_model == "org/saved-from"
    odd = _card(
        tmp_path, "org/name..bad"
    ).data  # not a valid Hub id (a path elsewhere?): the cache lookup does not raise
    assert odd.base_model is None and odd.license == "other"
    none = _card(tmp_path, None).data
    assert none.base_model is None and getattr(none, "base_model_relation", None) is None
    assert none.license == "other" and none.pipeline_tag == "text-to-image"


def test_model_card_recipe_fence_outlasts_backticks_in_the_recipe(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump({"prompts": ["a sign reading ``` and ````"]}))
    _model_card({**MANIFEST, "base_model": None}, run, "lora").save(tmp_path / "README.md")
    text = ModelCard.load(tmp_path / "README.md").text
    fence = "`" * 5  # one longer than the longest run inside
    block = text.split(f"{fence}yaml\n", 1)[1].split(f"\n{fence}\n", 1)[0]
    assert yaml.safe_load(block) == {"prompts": ["a sign reading ``` and ````"]}


# ------------------------------------------------------------------------ what export writes, and where it refuses


def _checkpointed_run(run, lora_files=("pytorch_lora_weights.safetensors",)):
    """A run directory (its recipe.yaml) with one checkpoint whose ``lora/`` holds ``lora_files``."""
    from safetensors.torch import save_file

    from rlpost.engine.checkpoint import write_checkpoint
    from tests.toy_components import toy_recipe

    def lora(directory):
        for name in lora_files:
            (directory / "lora" / name).parent.mkdir(parents=True, exist_ok=True)
            save_file({"lora_A.weight": torch.ones(4, 2)}, str(directory / "lora" / name))

    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump(toy_recipe(str(run))))
    return write_checkpoint(
        run, 1, {"trainable.0000": torch.ones(2)}, {"step": 1}, extra=lora, manifest_extra={**MANIFEST, "step": 1}
    )


def test_export_never_overwrites_a_file_it_did_not_write(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "out"
    _checkpointed_run(run)
    out.mkdir()
    (out / "README.md").write_text("my notes\n")
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"export directory {out} already holds README.md" in err and "--force" in err
    assert (out / "README.md").read_text() == "my notes\n"
    assert not (out / "pytorch_lora_weights.safetensors").exists()  # refused before anything was written
    assert cli.main(["export", "--run", str(run), "--out", str(out), "--force"]) == 0
    assert ModelCard.load(out / "README.md").data.library_name == "diffusers"
    written = {f.name: f.read_bytes() for f in out.iterdir()}
    # Exporting the same checkpoint again writes exactly what is there: nothing to refuse.
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert {f.name: f.read_bytes() for f in out.iterdir()} == written


def test_export_force_replaces_a_link_not_the_file_it_points_to(tmp_path):
    from rlpost.apps.export import export_run

    run, out = tmp_path / "run", tmp_path / "out"
    _checkpointed_run(run)
    out.mkdir()
    elsewhere = tmp_path / "precious.md"
    elsewhere.write_text("keep me\n")
    (out / "README.md").symlink_to(elsewhere)
    with pytest.raises(FileExistsError, match="README.md"):
        export_run(run, out)
    export_run(run, out, force=True)
    assert elsewhere.read_text() == "keep me\n" and not (out / "README.md").is_symlink()


@pytest.mark.parametrize("inside", ["lora", ".", "../.."], ids=["its-lora", "the-checkpoint", "the-run"])
def test_export_into_the_checkpoint_is_refused(tmp_path, capsys, inside):
    run = tmp_path / "run"
    ckpt = _checkpointed_run(run)
    files = sorted(p for p in ckpt.rglob("*"))
    out = (ckpt / inside).resolve()
    status = cli.main(["export", "--run", str(run), "--out", str(out)])
    if inside == "../..":  # the run directory itself is a place like any other
        assert status == 0 and (run / "pytorch_lora_weights.safetensors").is_file()
        return
    assert status == 2
    err = capsys.readouterr().err
    assert "lies inside" in err and "corrupting it" in err and "Traceback" not in err
    assert sorted(p for p in ckpt.rglob("*")) == files


def test_export_copies_only_what_the_manifest_lists(tmp_path):
    from rlpost.apps.export import export_run

    run, out = tmp_path / "run", tmp_path / "out"
    ckpt = _checkpointed_run(run, ("pytorch_lora_weights.safetensors", "extra/adapter_config.safetensors"))
    (ckpt / "lora" / "empty").mkdir()  # an empty folder: nothing to copy, not an error
    export_run(run, out)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "README.md",
        "extra/adapter_config.safetensors",
        "pytorch_lora_weights.safetensors",
    ]
    assert not (out / "empty").exists()


def test_export_and_sample_name_a_missing_or_broken_run_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "get_host", lambda: build_host(load_entrypoints=False, extra_plugins=(toy_components,)))
    run = tmp_path / "run"
    for command in (["export"], ["sample", "--prompt", "a cat"]):
        args = [*command, "--run", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert f"run directory {tmp_path / 'nowhere'} does not exist" in err and "--resume" not in err
    _checkpointed_run(run)
    (run / "recipe.yaml").write_text("run: {seed: [\n")
    for command in (["export"], ["sample", "--prompt", "a cat"]):
        assert cli.main([*command, "--run", str(run), "--out", str(tmp_path / "o")]) == 2
        assert f"{run / 'recipe.yaml'}: not a readable YAML recipe" in capsys.readouterr().err
    (run / "recipe.yaml").unlink()
    for command in (["export"], ["sample", "--prompt", "a cat"]):
        assert cli.main([*command, "--run", str(run), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert f"{run / 'recipe.yaml'} not found" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_lora_settings_accept_peft_names(tiny_sd3_dir, tmp_path):
    from peft import LoraConfig

    from rlpost.engine.recipe import RecipeError
    from rlpost.models.adapter_settings import LoraSpec

    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    cfg = toy_components.toy_recipe(str(tmp_path / "run"))
    cfg["model"] = {
        "class_path": "sd3",
        "init_args": {"pretrained": str(tiny_sd3_dir), "resolution": 32, "lora": {"r": 4, "lora_alpha": 8}},
    }
    recipe = validate(cfg, host)
    assert recipe.config["model"]["init_args"]["lora"] == {"rank": 4, "alpha": 8}  # recipe.yaml: rlpost's names
    peft = recipe.model.lora.to_peft()  # type: ignore[attr-defined]
    assert isinstance(peft, LoraConfig) and (peft.r, peft.lora_alpha) == (4, 8)
    assert (LoraSpec(r=2, lora_alpha=3, lora_dropout=0.5).rank, LoraSpec(lora_alpha=3).alpha) == (2, 3)
    cfg["model"]["init_args"]["lora"] = {"rank": 16, "r": 4}
    with pytest.raises(RecipeError, match=r"model.init_args.lora: rank=16 and peft's r=4 disagree; give one"):
        validate(cfg, host)
