"""What every model adapter reads from its model directory in ``validate``, without loading weights: the pipeline
family (``model_index.json``'s ``_class_name``) and the configs the resolution is checked against, each problem a
``model.init_args.*`` line; before, an SD3 recipe pointed at a FLUX.1 pipeline and an unreadable config passed
``validate`` and ``train`` died after writing its run directory.

The directories are the stand-ins of ``tests/weights_standins.py``: real ``model_index.json`` and configs, empty
weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.apps import cli
from rlpost.apps.host import reset_host
from rlpost.models import FluxPolicy, ModelDirError, SD3Policy
from rlpost.models.wan import WanPolicy
from rlpost_qwenimage.policy import QwenImagePolicy
from tests.weights_standins import write_flux_standin, write_qwenimage_standin, write_sd3_standin, write_wan_standin

ROOT = Path(__file__).resolve().parents[3]

# adapter, its recipe name, the pipeline class it loads, a stand-in of its family, constructor arguments that fit it
FAMILIES: list[tuple[type, str, str, Callable[[Path], Path], dict[str, Any]]] = [
    (SD3Policy, "sd3", "StableDiffusion3Pipeline", write_sd3_standin, {"resolution": 512}),
    (FluxPolicy, "flux", "FluxPipeline", write_flux_standin, {"resolution": 512}),
    (WanPolicy, "wan", "WanPipeline", write_wan_standin, {"height": 480, "width": 832, "num_frames": 81}),
    (QwenImagePolicy, "qwen-image", "QwenImagePipeline", write_qwenimage_standin, {"resolution": 512}),
]
IDS = [name for _, name, *_ in FAMILIES]


@pytest.fixture(autouse=True)
def _no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("validation must not load a pipeline")

    for _, _, pipeline, *_ in FAMILIES:
        monkeypatch.setattr(getattr(diffusers, pipeline), "from_pretrained", forbidden)


@pytest.mark.parametrize("own", FAMILIES, ids=IDS)
def test_each_adapter_validates_its_own_family(own, tmp_path: Path) -> None:
    adapter, _, _, write, kwargs = own
    assert adapter(str(write(tmp_path / "m")), **kwargs).validate(None) == []


CROSSED = [(own, other) for own in FAMILIES for other in FAMILIES if own is not other]


@pytest.mark.parametrize(("own", "other"), CROSSED, ids=[f"{a[1]}-on-{b[1]}" for a, b in CROSSED])
def test_a_pipeline_of_another_family_is_refused_naming_the_adapter_that_loads_it(own, other, tmp_path: Path) -> None:
    adapter, _, expected, _, kwargs = own
    _, other_name, found, write, _ = other
    directory = write(tmp_path / "m")
    (problem,) = adapter(str(directory), **kwargs).validate(None)
    head, hint = problem.split("; use model class_path ")
    assert head == (
        f"model.init_args.pretrained: {str(directory)!r} holds a {found} (model_index.json _class_name), not the "
        f"{expected} this adapter loads"
    )
    # Every adapter class defined in the process that loads that pipeline is named (a test elsewhere may have defined
    # another one, e.g. the model example of docs/plugin_hooks.md): the family's own adapter must be among them.
    assert other_name in hint.split(" or "), hint


def test_setup_refuses_another_family_before_loading(tmp_path: Path) -> None:
    flux = write_flux_standin(tmp_path / "flux")
    with pytest.raises(ModelDirError, match="holds a FluxPipeline"):
        SD3Policy(str(flux), resolution=512).setup(torch.device("cpu"))


@pytest.mark.parametrize("own", FAMILIES, ids=IDS)
@pytest.mark.parametrize(
    ("text", "message"),
    [("{", "is not valid JSON"), ("[]", "is malformed: expected a JSON object")],
)
def test_an_unreadable_config_is_a_problem_naming_the_file(own, text: str, message: str, tmp_path: Path) -> None:
    adapter, _, _, write, kwargs = own
    directory = write(tmp_path / "m")
    (directory / "vae" / "config.json").write_text(text)
    (problem,) = adapter(str(directory), **kwargs).validate(None)
    assert problem.startswith("model.init_args.pretrained:") and str(directory / "vae" / "config.json") in problem
    assert message in problem


@pytest.mark.parametrize(
    ("adapter", "write", "key"),
    [
        (SD3Policy, write_sd3_standin, "block_out_channels"),
        (FluxPolicy, write_flux_standin, "block_out_channels"),
        (QwenImagePolicy, write_qwenimage_standin, "temperal_downsample"),
    ],
)
def test_a_config_without_the_vae_factor_is_a_problem(adapter, write, key: str, tmp_path: Path) -> None:
    directory = write(tmp_path / "m")
    (directory / "vae" / "config.json").write_text("{}")
    (problem,) = adapter(str(directory), resolution=512).validate(None)
    assert problem.startswith("model.init_args.pretrained:") and f"has no {key}" in problem


def test_resolution_is_read_from_each_familys_configs(tmp_path: Path) -> None:
    """SD3.5: VAE 8 x patch 2 = 16, at most 192 patches; FLUX.1: VAE 8 x 2x2 packing; Qwen-Image: VAE 8 x 2x2."""
    sd3 = str(write_sd3_standin(tmp_path / "sd3"))
    assert SD3Policy(sd3, resolution=520).validate(None) == [
        "model.init_args.resolution: 520 is not a multiple of 16 (VAE factor 8 x patch size 2)"
    ]
    (big,) = SD3Policy(sd3, resolution=4096).validate(None)
    assert big.startswith("model.init_args.resolution: 4096 is too large for this model: at most 3072")
    flux = str(write_flux_standin(tmp_path / "flux"))
    assert FluxPolicy(flux, resolution=520).validate(None) == [
        "model.init_args.resolution: 520 is not a multiple of 16 (VAE factor 8 x 2x2 latent packing)"
    ]
    qwen = str(write_qwenimage_standin(tmp_path / "qwen"))
    assert QwenImagePolicy(qwen, resolution=520).validate(None) == [
        "model.init_args.resolution: 520 is not a multiple of 16 (VAE factor 8 x 2x2 latent packing)"
    ]


def test_the_tiny_sd3_resolution_is_checked_without_building_it(tmp_path: Path, monkeypatch) -> None:
    """``tiny-random`` is built on first use: validate checks it against the geometry it will be built with (VAE 2 x
    patch 2, 8 positional patches: at most 32 px)."""
    monkeypatch.setenv("RLPOST_CACHE", str(tmp_path / "cache"))
    assert SD3Policy("tiny-random", resolution=32).validate(None) == []
    assert SD3Policy("tiny-random", resolution=30).validate(None) == [
        "model.init_args.resolution: 30 is not a multiple of 4 (VAE factor 2 x patch size 2)"
    ]
    (big,) = SD3Policy("tiny-random", resolution=64).validate(None)
    assert big.startswith("model.init_args.resolution: 64 is too large for this model: at most 32")
    assert not (tmp_path / "cache").exists()


def test_a_hub_id_that_may_still_download_keeps_its_behaviour() -> None:
    """Offline validation of a recipe naming a hub id: not cached and allowed to download, nothing is read."""
    for adapter, _, _, _, kwargs in FAMILIES:
        assert adapter("rlpost-test/not-cached", local_files_only=False, **kwargs).validate(None) == []
        (problem,) = adapter("rlpost-test/not-cached", **kwargs).validate(None)
        assert "is not in the local Hugging Face cache" in problem


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--model.init_args.resolution", "30"], "model.init_args.resolution: 30 is not a multiple of 4"),
        (["--model.init_args.pretrained", "FLUX"], "holds a FluxPipeline (model_index.json _class_name)"),
    ],
)
def test_train_refuses_before_writing_anything(options, message: str, tmp_path: Path, capsys) -> None:
    flux = write_flux_standin(tmp_path / "flux")
    options = [str(flux) if o == "FLUX" else o for o in options]
    out = tmp_path / "run"
    recipe = ROOT / "recipes" / "tiny" / "treegrpo.yaml"
    reset_host(None)
    try:
        rc = cli.main(["train", "--recipe", str(recipe), "--run.output_dir", str(out), *options])
    finally:
        reset_host(None)
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and message in err, err
    assert "Traceback" not in err and not out.exists()
