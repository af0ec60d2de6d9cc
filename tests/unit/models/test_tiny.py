"""The tiny SD3 and FLUX builders: real architecture, deterministic, small, loadable through from_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import StableDiffusion3Pipeline
from safetensors.torch import load_file

from rlpost.models.tiny import build_tiny_sd3, main
from rlpost.models.tiny_text import write_clip_tokenizer_files


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_tiny_pipeline_loads_and_is_small(tiny_sd3_dir: Path) -> None:
    assert (tiny_sd3_dir / "model_index.json").is_file()
    assert _dir_size(tiny_sd3_dir) < 3_000_000
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir), local_files_only=True)
    assert pipe.vae_scale_factor == 2 and pipe.transformer.config.patch_size == 2
    for m in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        assert not m.training
    ids = pipe.tokenizer("a photo of a cat").input_ids
    assert ids[0] == pipe.tokenizer.bos_token_id and ids[-1] == pipe.tokenizer.eos_token_id and len(ids) > 3
    assert pipe.tokenizer.model_max_length == 77
    assert len(pipe.tokenizer_3("a photo of a cat").input_ids) > 1


def test_tiny_builder_is_deterministic(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_sd3(tmp_path / "again", seed=0)
    other = build_tiny_sd3(tmp_path / "other", seed=1)
    name = "transformer/diffusion_pytorch_model.safetensors"
    a, b, c = (load_file(str(d / name)) for d in (tiny_sd3_dir, again, other))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_clip_tokenizer_files(tmp_path: Path) -> None:
    assert write_clip_tokenizer_files(tmp_path, 1000) == 512 + 1000 + 2
    assert (tmp_path / "merges.txt").read_text().startswith("#version: 0.2\n")


def test_cli(tmp_path: Path, capsys: object) -> None:
    main([str(tmp_path / "cli"), "--seed", "3"])
    assert (tmp_path / "cli" / "transformer" / "config.json").is_file()


def test_tiny_flux_pipeline_loads_and_is_small(tiny_flux_dir: Path) -> None:
    from diffusers import FluxPipeline

    assert _dir_size(tiny_flux_dir) < 3_000_000
    pipe = FluxPipeline.from_pretrained(str(tiny_flux_dir), local_files_only=True)
    assert pipe.vae_scale_factor == 2 and pipe.transformer.config.in_channels == 4 * pipe.vae.config.latent_channels
    assert pipe.transformer.config.guidance_embeds and pipe.scheduler.config.use_dynamic_shifting
    assert len(pipe.transformer.transformer_blocks) == 1 and len(pipe.transformer.single_transformer_blocks) == 1
    for m in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        assert not m.training
    assert type(pipe.text_encoder).__name__ == "CLIPTextModel"  # FLUX uses CLIP's pooled output, no projection


def test_tiny_flux_builder_is_deterministic_and_has_a_cli(tiny_flux_dir: Path, tmp_path: Path) -> None:
    main([str(tmp_path / "again"), "--family", "flux"])
    name = "transformer/diffusion_pytorch_model.safetensors"
    a, b = (load_file(str(d / name)) for d in (tiny_flux_dir, tmp_path / "again"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
