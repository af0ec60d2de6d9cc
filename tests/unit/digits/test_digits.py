"""The digits world: data and prompts, identity VAE, classifier, ``digit-alignment`` reward, the shipped pipeline
loaded through ``SD3Policy`` and a 2-step pretraining run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.digits import DIGITS_SD3_DIR, rlpost_register_prompt_sources, rlpost_register_reward_sources
from rlpost.digits.classifier import heldout_accuracy, load_classifier
from rlpost.digits.data import (
    HELDOUT_TEMPLATES,
    TRAIN_TEMPLATES,
    digit_from_prompt,
    digits_to_uint8_rgb,
    load_split,
    prompts_for,
    upsample_digits,
)
from rlpost.digits.evaluate import DEFAULT_GUIDANCE, generate
from rlpost.digits.pretrain import CLIP_MAX_LENGTH, MAX_SEQUENCE_LENGTH, identity_vae, pretrain
from rlpost.digits.prompts import DigitsPrompts
from rlpost.digits.reward import DigitAlignmentReward, requested_digit
from rlpost.models.sd3 import SD3Policy

# The shipped model clears this with margin at NFE 10, CFG 4, seed 0 (docs/digits.md reports the 200-sample score).
SAMPLE_ACCURACY_FLOOR = 0.8
CLASSIFIER_HELDOUT_FLOOR = 0.95


@pytest.fixture(scope="module")
def reward() -> DigitAlignmentReward:
    r = DigitAlignmentReward()
    r.setup(torch.device("cpu"))
    return r


@pytest.fixture(scope="module")
def policy() -> SD3Policy:
    p = SD3Policy(
        pretrained=str(DIGITS_SD3_DIR),
        resolution=16,
        guidance_scale=DEFAULT_GUIDANCE,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
    )
    p.setup(torch.device("cpu"))
    return p


# ------------------------------------------------------------------------------------------------ data, prompts


def test_split_is_fixed_and_disjoint() -> None:
    xt, yt = load_split("train")
    xh, yh = load_split("heldout")
    assert xt.shape == (1437, 8, 8) and xh.shape == (360, 8, 8)
    assert set(yt.tolist()) == set(yh.tolist()) == set(range(10))
    assert float(xt.max()) == 16.0 and float(xt.min()) == 0.0


def test_digit_from_prompt() -> None:
    assert digit_from_prompt("a handwritten digit 7") == 7
    assert digit_from_prompt("the number Seven") == 7
    assert digit_from_prompt("a 3 and a three") == 3
    assert digit_from_prompt("a 3 and a 4") is None
    assert digit_from_prompt("a cat") is None
    assert digit_from_prompt("the number 17") is None  # not a single digit
    assert all(digit_from_prompt(p) == d for p, d in prompts_for(TRAIN_TEMPLATES + HELDOUT_TEMPLATES))


def test_prompt_source_is_deterministic_with_metadata() -> None:
    a, b = DigitsPrompts().load(), DigitsPrompts().load()
    assert a == b and len(a) == 10 * len(TRAIN_TEMPLATES)
    prompt, meta = a[7]
    assert prompt == "a handwritten digit 7" and meta == {"digit": 7, "template": TRAIN_TEMPLATES[0]}
    held = DigitsPrompts(split="heldout").load()
    assert {m["template"] for _, m in held} == set(HELDOUT_TEMPLATES)
    assert not {p for p, _ in held} & {p for p, _ in a}  # held-out prompts never seen in pretraining
    only7 = DigitsPrompts(templates=["a tiny {word}"], digits=[7]).load()
    assert only7 == [("a tiny seven", {"digit": 7, "template": "a tiny {word}"})]
    assert DigitsPrompts(templates=["no placeholder"]).validate(None)
    with pytest.raises(ValueError, match="0..9"):
        DigitsPrompts(digits=[12]).load()


def test_hooks_register_components() -> None:
    got: list[type] = []
    rlpost_register_reward_sources(register=got.append)
    rlpost_register_prompt_sources(register=got.append)
    assert [c.name for c in got] == ["digit-alignment", "digit-prompts"]


def test_prompts_fit_the_token_budgets(policy: SD3Policy) -> None:
    """Truncation would silently change the conditioning: every template must fit both tokenizers."""
    for prompt, _ in prompts_for(TRAIN_TEMPLATES + HELDOUT_TEMPLATES):
        assert len(policy.pipe.tokenizer(prompt)["input_ids"]) <= CLIP_MAX_LENGTH
        assert len(policy.pipe.tokenizer_3(prompt)["input_ids"]) <= MAX_SEQUENCE_LENGTH


# -------------------------------------------------------------------------------------------- VAE, classifier


def test_identity_vae_decodes_to_pixels() -> None:
    vae = identity_vae()
    x = upsample_digits(load_split("heldout")[0][:16])
    with torch.no_grad():
        out = vae.decode(x, return_dict=False)[0]
        enc = vae.encode(out).latent_dist.mode()
    assert out.shape == (16, 3, 16, 16)
    assert torch.allclose(out, x.expand(-1, 3, -1, -1), atol=1e-3)
    assert torch.allclose(enc, x, atol=1e-3)


def test_classifier_heldout_accuracy() -> None:
    model = load_classifier()
    assert heldout_accuracy(model) >= CLASSIFIER_HELDOUT_FLOOR
    assert not any(p.requires_grad for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- reward


def test_reward_on_real_digits_batched_equals_single(reward: DigitAlignmentReward) -> None:
    images, labels = load_split("heldout")
    imgs = digits_to_uint8_rgb(images[:24])  # what a perfect generator would decode
    prompts = [f"a handwritten digit {int(d)}" for d in labels[:24]]
    meta: list[dict[str, Any]] = [{} for _ in prompts]  # digit parsed from the prompt
    batched = reward.score(imgs, prompts, meta)
    single = torch.cat([reward.score(imgs[i : i + 1], prompts[i : i + 1], meta[i : i + 1]) for i in range(24)])
    assert batched.shape == (24,) and batched.dtype == torch.float32
    assert torch.allclose(batched, single, atol=1e-6)
    assert float(batched.min()) >= 0.0 and float(batched.max()) <= 1.0
    assert float(batched.mean()) > 0.8
    wrong = reward.score(imgs, prompts, [{"digit": (int(d) + 1) % 10} for d in labels[:24]])  # metadata wins
    assert float(wrong.mean()) < 0.2


def test_reward_errors_without_a_digit(reward: DigitAlignmentReward) -> None:
    img = torch.zeros(1, 16, 16, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="cannot tell which digit"):
        reward.score(img, ["a photo of a cat"], [{}])
    with pytest.raises(ValueError, match="0..9"):
        requested_digit("a 7", {"digit": 12})
    assert requested_digit("a photo", {"digit": "4"}) == 4


# --------------------------------------------------------------------------------------- pipeline, pretraining


def test_shipped_pipeline_samples_the_prompted_digits(policy: SD3Policy, reward: DigitAlignmentReward) -> None:
    meta = json.loads((DIGITS_SD3_DIR / "rlpost_digits.json").read_text())
    assert meta["max_sequence_length"] == MAX_SEQUENCE_LENGTH and meta["resolution"] == 16
    assert policy.latent_shape == (1, 16, 16)
    items = DigitsPrompts().load()[:10]  # "a handwritten digit 0" ... "9"
    images = generate(policy, [p for p, _ in items], nfe=10, seed=0)
    assert images.shape == (10, 16, 16, 3) and images.dtype == torch.uint8
    probs = reward._model.predict_proba_images(images)
    accuracy = float((probs.argmax(-1) == torch.arange(10)).float().mean())
    assert accuracy >= SAMPLE_ACCURACY_FLOOR, f"sample accuracy {accuracy:.2f}"


def test_asset_is_small() -> None:
    size = sum(f.stat().st_size for f in DIGITS_SD3_DIR.rglob("*") if f.is_file())
    assert size < 20 * 2**20


def test_pretraining_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "digits"
    meta = pretrain(out, steps=2, batch_size=8, log_every=0)
    assert meta["steps_done"] == 2
    pretrain(tmp_path / "again", steps=2, batch_size=8, log_every=0)  # same seed -> identical weights
    weights = Path("transformer") / "diffusion_pytorch_model.safetensors"
    assert (out / weights).read_bytes() == (tmp_path / "again" / weights).read_bytes()
    p = SD3Policy(pretrained=str(out), resolution=16, guidance_scale=2.0, max_sequence_length=MAX_SEQUENCE_LENGTH)
    p.setup(torch.device("cpu"))
    images = generate(p, ["a handwritten digit 3", "the number seven"], nfe=2, seed=0)
    assert images.shape == (2, 16, 16, 3)
