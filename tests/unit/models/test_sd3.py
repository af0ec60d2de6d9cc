"""SD3Policy on a tiny real-architecture pipeline: pipeline equivalence, caching, ratios, LoRA, errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from rlpost.models import LoraSpec, ModelDirError, SD3Policy
from rlpost.models import sd3 as sd3_module
from rlpost.ops.kernels import EulerODE, FlowGRPOSDE, StepKernel
from rlpost.ops.schedules import sd3_sigmas
from tests.tolerances import assert_fp32_close

PROMPTS = ["a photo of a cat", "a red dog"]
NFE = 5


def _sample(policy: SD3Policy, x: torch.Tensor, prompts: list[str], kernel: StepKernel, nfe: int) -> torch.Tensor:
    cond = policy.encode(prompts)
    sig = policy.sigmas(nfe)
    b = x.shape[0]
    with torch.no_grad():
        for i in range(nfe):
            s, sn = sig[i].expand(b), sig[i + 1].expand(b)
            x = kernel.step(x, policy.velocity(x, s, cond), s, sn, None).next_latents
    return x


def _perturb_lora(policy: SD3Policy, scale: float = 0.5) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _pipe(tiny_sd3_dir: Path) -> StableDiffusion3Pipeline:
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("guidance", [4.5, 1.0], ids=["cfg", "no-cfg"])
def test_ode_sampling_reproduces_pipeline(
    make_sd3_policy: Callable[..., SD3Policy], tiny_sd3_dir: Path, guidance: float
) -> None:
    policy = make_sd3_policy(guidance_scale=guidance)
    x0 = policy.initial_noise(2, torch.Generator().manual_seed(0))
    assert x0.shape == (2, 4, 16, 16) and x0.dtype == torch.float32
    ours = _sample(policy, x0, PROMPTS, EulerODE(), NFE)
    assert policy.forward_count == 2 * NFE  # rows, before CFG doubling
    pipe = _pipe(tiny_sd3_dir)
    kw: dict[str, Any] = dict(
        num_inference_steps=NFE, guidance_scale=guidance, height=32, width=32, max_sequence_length=32
    )
    ref = pipe(PROMPTS, latents=x0.clone(), output_type="latent", **kw).images
    assert (ours - ref).abs().max() <= 1e-5
    img = policy.decode(ours)
    assert img.shape == (2, 1, 32, 32, 3) and img.dtype == torch.uint8  # one-frame media
    img = img[:, 0]
    ref_img = pipe(PROMPTS, latents=x0.clone(), output_type="pt", **kw).images  # [B, 3, H, W] in [0, 1]
    ref_u8 = (ref_img * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert (img.int() - ref_u8.int()).abs().max() <= 1


def test_initial_noise_matches_diffusers_randn(make_sd3_policy: Callable[..., SD3Policy]) -> None:
    policy = make_sd3_policy()
    a = policy.initial_noise(3, torch.Generator().manual_seed(4))
    b = torch.randn(3, 4, 16, 16, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b)


def test_sigmas_use_scheduler_shift(make_sd3_policy: Callable[..., SD3Policy]) -> None:
    policy = make_sd3_policy()
    assert torch.equal(policy.sigmas(10), sd3_sigmas(10, 3.0))


def test_encode_is_cached_per_prompt(
    make_sd3_policy: Callable[..., SD3Policy], monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = make_sd3_policy(guidance_scale=4.5)
    calls: list[list[str]] = []
    real = policy.pipe.encode_prompt

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(list(kwargs["prompt"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(policy.pipe, "encode_prompt", spy)
    c1 = policy.encode(["a", "b", "a"])
    c2 = policy.encode(["b", "c", "a", "a"])
    assert calls == [["a", "b"], ["c"]]
    assert set(c1.tensors) == {
        "prompt_embeds",
        "pooled_prompt_embeds",
        "negative_prompt_embeds",
        "negative_pooled_prompt_embeds",
    }
    assert c1.tensors["prompt_embeds"].shape[0] == 3 and c2.tensors["pooled_prompt_embeds"].shape[0] == 4
    assert torch.equal(c1.tensors["prompt_embeds"][0], c2.tensors["prompt_embeds"][2])
    sel = c2.select(torch.tensor([1, 1]))
    assert torch.equal(sel.tensors["prompt_embeds"][0], c2.tensors["prompt_embeds"][1])
    no_cfg = make_sd3_policy(guidance_scale=1.0).encode(["a"])
    assert set(no_cfg.tensors) == {"prompt_embeds", "pooled_prompt_embeds"}


@pytest.mark.parametrize("guidance", [4.5, 1.0], ids=["cfg", "no-cfg"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_recomputed_log_prob_gives_ratio_one(
    make_sd3_policy: Callable[..., SD3Policy], guidance: float, lora: bool
) -> None:
    """XueZeyue/DanceGRPO issue #87 check: before any update, exp(logp_new - logp_old) == 1 up to fp32 rounding."""
    # LoRA runs with gradient checkpointing too: recomputation in backward must not change the forward.
    kw: dict[str, Any] = (
        {"lora": LoraSpec(rank=4, alpha=4), "gradient_checkpointing": True} if lora else {"full_finetune": True}
    )
    policy = make_sd3_policy(guidance_scale=guidance, **kw)
    if lora:
        _perturb_lora(policy)
    kernel = FlowGRPOSDE(0.7)
    cond = policy.encode(PROMPTS)
    sig = policy.sigmas(4)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    stored = []
    policy.train(False)
    with torch.no_grad():
        for i in range(4):
            s, sn = sig[i].expand(2), sig[i + 1].expand(2)
            out = kernel.step(x, policy.velocity(x, s, cond), s, sn, gen)
            stored.append((x, s, sn, out.next_latents, out.log_prob))
            x = out.next_latents
    policy.train(True)
    for x_i, s, sn, nxt, old in stored:
        mean, std = kernel.mean_std(x_i, policy.velocity(x_i, s, cond), s, sn)
        new = kernel.log_prob(nxt, mean, std)
        assert new.requires_grad
        ratio = torch.exp(new - old)
        # Not bitwise: the recomputation runs with autograd (and checkpointing) on, which may take other kernels.
        # 1e-6 leaves room for last-bit differences of the forward (bitwise equal on our CPU); a log-prob computed
        # differently at the two ends (XueZeyue/DanceGRPO issue #87: another std or reduction) is off by orders more.
        assert torch.allclose(ratio, torch.ones_like(ratio), rtol=0, atol=1e-6), ratio
        new.sum().backward()  # gradients flow (through checkpointed blocks for LoRA)


def test_lora_gradients_only_reach_adapter(make_sd3_policy: Callable[..., SD3Policy]) -> None:
    policy = make_sd3_policy(lora=LoraSpec(rank=4, alpha=8), guidance_scale=4.5)
    _perturb_lora(policy)
    params = policy.trainable_parameters()
    names = {n for n, p in policy.transformer.named_parameters() if p.requires_grad}
    assert params and all("lora_" in n for n in names)
    assert len(names) == len(params)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    policy.train(True)
    v = policy.velocity(x, torch.full((2,), 0.7), policy.encode(PROMPTS))
    v.square().mean().backward()
    for n, p in policy.transformer.named_parameters():
        if "lora_" in n:
            assert p.grad is not None
        else:
            assert p.grad is None
    for m in (policy.pipe.text_encoder, policy.pipe.text_encoder_2, policy.pipe.text_encoder_3, policy.pipe.vae):
        assert all(p.grad is None and not p.requires_grad for p in m.parameters())


def test_saved_lora_loads_into_fresh_pipeline(
    make_sd3_policy: Callable[..., SD3Policy], tiny_sd3_dir: Path, tmp_path: Path
) -> None:
    policy = make_sd3_policy(lora=LoraSpec(rank=4, alpha=8), guidance_scale=4.5)
    x0 = policy.initial_noise(1, torch.Generator().manual_seed(3))
    base = _sample(policy, x0, PROMPTS[:1], EulerODE(), 3)
    _perturb_lora(policy)
    trained = _sample(policy, x0, PROMPTS[:1], EulerODE(), 3)
    assert (trained - base).abs().max() > 1e-3  # the adapter has an effect
    out = policy.save_lora(tmp_path / "lora")
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    pipe = _pipe(tiny_sd3_dir)
    pipe.load_lora_weights(str(out))
    ref = pipe(
        PROMPTS[:1],
        latents=x0.clone(),
        num_inference_steps=3,
        guidance_scale=4.5,
        height=32,
        width=32,
        max_sequence_length=32,
        output_type="latent",
    ).images
    assert (ref - trained).abs().max() <= 1e-5


def test_lora_reference_disables_adapter(make_sd3_policy: Callable[..., SD3Policy]) -> None:
    policy = make_sd3_policy(lora=LoraSpec(rank=4, alpha=8), guidance_scale=1.0)
    frozen = make_sd3_policy(guidance_scale=1.0)
    _perturb_lora(policy)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    s = torch.full((2,), 0.5)
    with torch.no_grad():
        v_pol = policy.velocity(x, s, policy.encode(PROMPTS))
        with policy.reference():
            v_ref = policy.velocity(x, s, policy.encode(PROMPTS))
        v_after = policy.velocity(x, s, policy.encode(PROMPTS))
        v_base = frozen.velocity(x, s, frozen.encode(PROMPTS))
    # Another model instance (and the adapter toggled off) is another code path: equal up to fp32 rounding. An
    # adapter left on would differ by the perturbed LoRA's effect (1.2 here).
    assert_fp32_close(v_ref, v_base)
    assert_fp32_close(v_after, v_pol)
    assert not torch.allclose(v_pol, v_ref)


def test_full_finetune_reference_copy(make_sd3_policy: Callable[..., SD3Policy]) -> None:
    policy = make_sd3_policy(full_finetune=True, reference=True, guidance_scale=1.0)
    n_all = sum(1 for _ in policy.transformer.parameters())
    assert len(policy.trainable_parameters()) == n_all
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    s, cond = torch.full((1,), 0.5), policy.encode(PROMPTS[:1])
    with torch.no_grad():
        before = policy.velocity(x, s, cond)
        for p in policy.trainable_parameters():
            p.add_(0.01)
        with policy.reference():
            ref = policy.velocity(x, s, cond)
        after = policy.velocity(x, s, cond)
    # The reference is a deep copy, whose weights sit at other memory alignments than the loaded ones, so the CPU
    # kernels may round differently (docs/design.md, "Determinism"; 2.4e-7 measured on an AMD EPYC). A reference
    # aliasing the trained weights would equal `after`, which moved by ~0.4.
    assert_fp32_close(ref, before)
    assert not torch.allclose(after, before)
    with pytest.raises(NotImplementedError, match="reference=True"):
        make_sd3_policy(full_finetune=True).reference()
    assert make_sd3_policy().trainable_parameters() == []


def test_bfloat16_weights_give_fp32_velocity(make_sd3_policy: Callable[..., SD3Policy]) -> None:
    policy = make_sd3_policy(dtype="bfloat16", lora=LoraSpec(rank=4, alpha=4))
    assert policy.weight_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    v = policy.velocity(x, torch.full((1,), 0.5), policy.encode(PROMPTS[:1]))
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_or_malformed_model_dir(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    def setup_error(path: Path | str) -> str:
        with pytest.raises((ModelDirError, OSError)) as info:
            SD3Policy(str(path), resolution=32).setup(torch.device("cpu"))
        return str(info.value)

    assert "does not exist" in setup_error(tmp_path / "nope")
    no_index = _copy(tiny_sd3_dir, tmp_path / "no_index")
    (no_index / "model_index.json").unlink()
    assert "missing model_index.json" in setup_error(no_index)
    no_tr = _copy(tiny_sd3_dir, tmp_path / "no_tr")
    shutil.rmtree(no_tr / "transformer")
    msg = setup_error(no_tr)
    assert "transformer/" in msg and str(no_tr) in msg
    bad_json = _copy(tiny_sd3_dir, tmp_path / "bad_json")
    (bad_json / "model_index.json").write_text("{not json")
    assert "not valid JSON" in setup_error(bad_json)
    no_entry = _copy(tiny_sd3_dir, tmp_path / "no_entry")
    index = json.loads((no_entry / "model_index.json").read_text())
    del index["vae"]
    (no_entry / "model_index.json").write_text(json.dumps(index))
    assert "'vae'" in setup_error(no_entry)
    no_w = _copy(tiny_sd3_dir, tmp_path / "no_w")
    (no_w / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    assert "no weights" in setup_error(no_w)
    # a corrupt weight file passes the checks; diffusers' error comes back wrapped with the path
    corrupt = _copy(tiny_sd3_dir, tmp_path / "corrupt")
    (corrupt / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"garbage")
    msg = setup_error(corrupt)
    assert "could not load" in msg and str(corrupt) in msg
    # validate() reports the same problem without loading anything
    problems = SD3Policy(str(no_tr), resolution=32).validate(None)
    assert len(problems) == 1 and "transformer/" in problems[0]
    assert SD3Policy(str(tiny_sd3_dir), resolution=32).validate(None) == []


def test_uncached_hub_id_error_names_it() -> None:
    with pytest.raises(OSError, match="rlpost-test/definitely-not-cached"):
        SD3Policy("rlpost-test/definitely-not-cached").setup(torch.device("cpu"))


def test_bad_resolution_and_conflicting_modes(make_sd3_policy: Callable[..., SD3Policy]) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        make_sd3_policy(resolution=30)
    with pytest.raises(ValueError, match="not both"):
        SD3Policy("x", lora=LoraSpec(), full_finetune=True)


def test_registers_through_hook() -> None:
    registered: list[type] = []
    sd3_module.rlpost_register_models(registered.append)
    assert registered == [SD3Policy] and SD3Policy.name == "sd3" and SD3Policy.kind == "model"
