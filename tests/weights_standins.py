"""Stand-ins for weights a recipe names but tests cannot download: diffusers SD3, FLUX, Wan and Qwen-Image pipeline
directories with real configs and empty weight files, placed in a scratch Hugging Face cache, and reward checkpoint
files under a scratch ``$RLPOST_MODELS``. Validation only checks that these exist and reads their configs, so a
stand-in lets a test validate a full-size recipe; loading one fails, which tests that must not load weights want
anyway."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

SD35_MEDIUM = "stabilityai/stable-diffusion-3.5-medium"
FLUX1_DEV = "black-forest-labs/FLUX.1-dev"
WAN21_T2V_1_3B = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
QWEN_IMAGE = "Qwen/Qwen-Image"

# Reward checkpoints the shipped recipes use, as default names under $RLPOST_MODELS (file or directory).
REWARD_FILES = (
    "HPS_v2.1_compressed.pt",
    "ImageReward/ImageReward.pt",
    "ImageReward/med_config.json",
    "sac+logos+ava1-l14-linearMSE.pth",
    "DFN5B-CLIP-ViT-H-14-384/open_clip_pytorch_model.bin",
)
# ... and directories (tokenizer and CLIP snapshots), as default names under $RLPOST_MODELS.
REWARD_DIRS = ("bert-base-uncased", "clip-vit-large-patch14", "PickScore_v1", "CLIP-ViT-H-14-laion2B-s32B-b79K")


def write_pipeline_standin(
    directory: Path,
    pipeline: str,
    components: dict[str, tuple[str, str]],
    configs: dict[str, dict[str, Any]],
    scheduler: dict[str, Any],
) -> Path:
    """A diffusers pipeline directory of class ``pipeline``: ``model_index.json`` listing ``components`` (name ->
    (library, class)), the scheduler's ``scheduler_config.json``, and for every other non-tokenizer component its
    ``config.json`` (``configs[name]``, else empty) and an empty weight file."""
    directory.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": pipeline, **{k: list(v) for k, v in components.items()}}
    (directory / "model_index.json").write_text(json.dumps(index))
    for name in components:
        sub = directory / name
        sub.mkdir(exist_ok=True)
        if name == "scheduler":
            (sub / "scheduler_config.json").write_text(json.dumps(scheduler))
        elif not name.startswith("tokenizer"):
            (sub / "config.json").write_text(json.dumps(configs.get(name, {})))
            (sub / "model.safetensors").write_bytes(b"")
    return directory


def write_sd3_standin(directory: Path, vae_blocks: int = 4, patch_size: int = 2, pos_embed_max_size: int = 192) -> Path:
    """An SD3-shaped pipeline directory: ``model_index.json``, each component's config and an empty weight file.

    Defaults follow SD3.5 Medium's configs (VAE factor 8, patch 2, 192 positional patches: at most 3072 pixels).
    """
    components = {
        "transformer": ("diffusers", "SD3Transformer2DModel"),
        "vae": ("diffusers", "AutoencoderKL"),
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "CLIPTextModelWithProjection"),
        "tokenizer": ("transformers", "CLIPTokenizer"),
        "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
        "tokenizer_2": ("transformers", "CLIPTokenizer"),
        "text_encoder_3": ("transformers", "T5EncoderModel"),
        "tokenizer_3": ("transformers", "T5TokenizerFast"),
    }
    configs = {
        "transformer": {"patch_size": patch_size, "pos_embed_max_size": pos_embed_max_size},
        "vae": {"block_out_channels": [128] * vae_blocks},
    }
    return write_pipeline_standin(directory, "StableDiffusion3Pipeline", components, configs, {})


def write_flux_standin(directory: Path) -> Path:
    """A FLUX.1-shaped pipeline directory (FLUX.1-dev's component layout, VAE factor 8, patch 1): ``model_index.json``,
    each component's config and an empty weight file."""
    components = {
        "transformer": ("diffusers", "FluxTransformer2DModel"),
        "vae": ("diffusers", "AutoencoderKL"),
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "CLIPTextModel"),
        "tokenizer": ("transformers", "CLIPTokenizer"),
        "text_encoder_2": ("transformers", "T5EncoderModel"),
        "tokenizer_2": ("transformers", "T5TokenizerFast"),
    }
    configs = {"transformer": {"patch_size": 1, "guidance_embeds": True}, "vae": {"block_out_channels": [128] * 4}}
    scheduler = {"use_dynamic_shifting": True, "shift": 3.0}
    return write_pipeline_standin(directory, "FluxPipeline", components, configs, scheduler)


def write_wan_standin(directory: Path) -> Path:
    """A Wan2.1-T2V-shaped pipeline directory (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``' component layout):
    ``model_index.json``, each component's config and an empty weight file.

    The configs hold what validation reads, with the released values: the transformer's 3-D patch and RoPE table,
    the VAE's levels (without ``scale_factor_*`` keys, which diffusers added for Wan2.2, so validation's fallback to
    the class defaults 8 / 4 is exercised) and the released UniPC scheduler config
    (:data:`rlpost.models.tiny_wan.WAN21_UNIPC_SCHEDULER`).
    """
    from rlpost.models.tiny_wan import WAN21_UNIPC_SCHEDULER

    components = {
        "transformer": ("diffusers", "WanTransformer3DModel"),
        "vae": ("diffusers", "AutoencoderKLWan"),
        "scheduler": ("diffusers", "UniPCMultistepScheduler"),
        "text_encoder": ("transformers", "UMT5EncoderModel"),
        "tokenizer": ("transformers", "T5TokenizerFast"),
    }
    configs = {
        "transformer": {"patch_size": [1, 2, 2], "in_channels": 16, "rope_max_seq_len": 1024, "num_layers": 30},
        "vae": {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "temperal_downsample": [False, True, True]},
    }
    return write_pipeline_standin(directory, "WanPipeline", components, configs, dict(WAN21_UNIPC_SCHEDULER))


def write_qwenimage_standin(directory: Path) -> Path:
    """A Qwen-Image-shaped pipeline directory (Qwen/Qwen-Image's component layout; its VAE's three temporal
    down-sampling flags make the VAE factor 8, so resolutions are multiples of 16), Qwen-Image's scheduler config,
    each component's config and an empty weight file."""
    from rlpost_qwenimage.tiny import QWEN_IMAGE_SCHEDULER_CONFIG

    components = {
        "transformer": ("diffusers", "QwenImageTransformer2DModel"),
        "vae": ("diffusers", "AutoencoderKLQwenImage"),
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
        "tokenizer": ("transformers", "Qwen2Tokenizer"),
    }
    configs = {
        "transformer": {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60},
        "vae": {"z_dim": 16, "temperal_downsample": [False, True, True]},
    }
    scheduler = dict(QWEN_IMAGE_SCHEDULER_CONFIG)
    return write_pipeline_standin(directory, "QwenImagePipeline", components, configs, scheduler)


def hub_cache_standin(cache: Path, repo_id: str, write: Any = write_sd3_standin) -> Path:
    """Place a stand-in (``write``: SD3 by default) in the Hugging Face cache layout under ``cache``; returns its
    snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    path: Path = write(repo / "snapshots" / commit)
    return path


def hub_dataset_standin(cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """Place data files of hub dataset ``repo_id`` in the Hugging Face cache layout under ``cache`` (as
    ``hf_hub_download`` leaves them) and return the snapshot directory; ``files`` maps repository paths to text."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="dataset")
    commit = "1" * 40
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for name, text in files.items():
        path = repo / "snapshots" / commit / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return repo / "snapshots" / commit


@pytest.fixture
def standin_weights(tmp_path_factory, monkeypatch) -> Path:
    """A scratch HF cache holding SD3.5 Medium, FLUX.1-dev, Wan2.1-T2V-1.3B and Qwen-Image, and a scratch
    ``$RLPOST_MODELS`` holding the reward checkpoints."""
    import huggingface_hub.constants

    root = tmp_path_factory.mktemp("standin-weights")
    hub_cache_standin(root / "hub", SD35_MEDIUM)
    hub_cache_standin(root / "hub", FLUX1_DEV, write_flux_standin)
    hub_cache_standin(root / "hub", WAN21_T2V_1_3B, write_wan_standin)
    hub_cache_standin(root / "hub", QWEN_IMAGE, write_qwenimage_standin)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root / "hub"))
    models = root / "models"
    models.mkdir()
    for name in REWARD_FILES:
        (models / name).parent.mkdir(parents=True, exist_ok=True)
        (models / name).write_bytes(b"")
    for name in REWARD_DIRS:
        (models / name).mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("RLPOST_MODELS", str(models))
    return root
