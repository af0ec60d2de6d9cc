"""The digits world: data and prompt splits, identity VAE, classifier, ``digit-alignment`` reward, the independent
``digit-judge``, the shipped pipeline loaded through ``SD3Policy`` and a 2-step pretraining run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.models.sd3 import SD3Policy
from rlpost_digits import DIGITS_SD3_DIR, rlpost_register_prompt_sources, rlpost_register_reward_sources
from rlpost_digits.classifier import DigitClassifier, heldout_accuracy, load_classifier
from rlpost_digits.data import (
    DIGIT_WORDS,
    EVAL_TEMPLATES,
    PROMPT_SPLITS,
    RL_TEMPLATES,
    TRAIN_TEMPLATES,
    digit_from_prompt,
    digits_to_uint8_rgb,
    load_split,
    prompts_for,
    upsample_digits,
)
from rlpost_digits.evaluate import DEFAULT_GUIDANCE, generate
from rlpost_digits.judge import DigitJudge, augment, judge_accuracy, load_judge, train_judge
from rlpost_digits.pretrain import CLIP_MAX_LENGTH, MAX_SEQUENCE_LENGTH, identity_vae, pretrain
from rlpost_digits.prompts import DigitsPrompts
from rlpost_digits.reward import DigitAlignmentReward, DigitJudgeReward, requested_digit

# The shipped model clears this with margin at NFE 10, CFG 4, seed 0 (docs/digits.md reports the 200-sample score).
SAMPLE_ACCURACY_FLOOR = 0.8
CLASSIFIER_HELDOUT_FLOOR = 0.95
# The shipped judge scores 98.9 % clean and 95.8 % on augmented (shifted/blurred) held-out digits (docs/digits.md).
JUDGE_HELDOUT_FLOOR = 0.97
JUDGE_AUGMENTED_FLOOR = 0.92
ALL_TEMPLATES = TRAIN_TEMPLATES + RL_TEMPLATES + EVAL_TEMPLATES


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
    assert all(digit_from_prompt(p) == d for p, d in prompts_for(ALL_TEMPLATES))


def test_prompt_source_is_deterministic_with_metadata() -> None:
    a, b = DigitsPrompts().load(), DigitsPrompts().load()
    assert a == b and len(a) == 10 * len(TRAIN_TEMPLATES)
    prompt, meta = a[7]
    assert prompt == "a handwritten digit 7" and meta == {"digit": 7, "template": TRAIN_TEMPLATES[0]}
    assert DigitsPrompts(split="train").load() == DigitsPrompts(split="pretrain").load() == a  # older name
    rl = DigitsPrompts(split="rl").load()
    assert {m["template"] for _, m in rl} == set(RL_TEMPLATES)
    only7 = DigitsPrompts(templates=["a tiny {word}"], digits=[7]).load()
    assert only7 == [("a tiny seven", {"digit": 7, "template": "a tiny {word}"})]
    assert DigitsPrompts(templates=["no placeholder"]).validate(None)
    with pytest.raises(ValueError, match="0..9"):
        DigitsPrompts(digits=[12]).load()


def test_prompt_splits_are_disjoint() -> None:
    """Evaluation prompts are never trained on: not in pretraining, not in RL; RL prompts are not in pretraining."""
    prompts = {name: {p for p, _ in DigitsPrompts(split=name).load()} for name in ("pretrain", "rl", "eval")}
    assert all(len(v) >= 30 for v in prompts.values())
    assert not prompts["eval"] & prompts["rl"]
    assert not prompts["eval"] & prompts["pretrain"]
    assert not prompts["rl"] & prompts["pretrain"]
    assert len(set(ALL_TEMPLATES)) == len(ALL_TEMPLATES)
    assert set(PROMPT_SPLITS) == {"pretrain", "train", "rl", "eval"}
    # Each split asks for digits both ways (numeral and word), as pretraining did.
    for templates in (TRAIN_TEMPLATES, RL_TEMPLATES, EVAL_TEMPLATES):
        assert any("{n}" in t for t in templates) and any("{word}" in t for t in templates)


def test_renamed_split_names_the_field_and_the_new_names() -> None:
    problems = DigitsPrompts(split="heldout").validate(None)
    assert len(problems) == 1 and problems[0].startswith("prompts.init_args.split:")
    assert "'rl'" in problems[0] and "'eval'" in problems[0]
    with pytest.raises(ValueError, match="split"):
        DigitsPrompts(split="bogus").load()


def test_hooks_register_components() -> None:
    got: list[type] = []
    rlpost_register_reward_sources(register=got.append)
    rlpost_register_prompt_sources(register=got.append)
    assert [c.name for c in got] == ["digit-alignment", "digit-judge", "digits-brightness", "digit-prompts"]


def test_brightness_demo_reward_pays_for_ink_not_digits() -> None:
    """digits-brightness (the planted hack of recipes/ablations/digits_hackable_reward.yaml) is the mean pixel value:
    a white square outscores a real digit, whatever the prompt asks for."""
    from rlpost_digits.reward import DigitsBrightnessReward

    images = torch.zeros(3, 16, 16, 3, dtype=torch.uint8)
    images[1, 4:12, 6:10] = 255  # a stroke: 32 of 256 pixels
    images[2] = 255
    scores = DigitsBrightnessReward().score(images, ["a 1"] * 3, [{"digit": 1}] * 3)
    torch.testing.assert_close(scores, torch.tensor([0.0, 32 / 256, 1.0]))
    with pytest.raises(ValueError, match="digits-brightness"):
        DigitsBrightnessReward().score(images, ["a 1"], [{}])


def test_prompts_fit_the_token_budgets(policy: SD3Policy) -> None:
    """Truncation would silently change the conditioning: every template must fit both tokenizers."""
    for prompt, _ in prompts_for(ALL_TEMPLATES):
        assert len(policy.pipe.tokenizer(prompt)["input_ids"]) <= CLIP_MAX_LENGTH
        assert len(policy.pipe.tokenizer_3(prompt)["input_ids"]) <= MAX_SEQUENCE_LENGTH


def test_prompts_tokenize_to_known_tokens(policy: SD3Policy) -> None:
    """Every word of every split is in the shipped vocabularies: no unknown token, no character fallback in T5, and
    the digit itself survives as one token (so the model can tell the prompts apart)."""
    clip, t5 = policy.pipe.tokenizer, policy.pipe.tokenizer_3
    for prompt, digit in prompts_for(ALL_TEMPLATES):
        # CLIP's unknown token is its end-of-text token: it may only close the sequence.
        clip_ids = clip(prompt)["input_ids"]
        assert clip.unk_token_id not in clip_ids[1:-1], prompt
        t5_ids = t5(prompt)["input_ids"]
        assert t5.unk_token_id not in t5_ids, prompt
        pieces = t5.convert_ids_to_tokens(t5_ids)[:-1]  # drop </s>
        assert pieces == ["\u2581" + w for w in prompt.split()], f"{prompt!r} -> {pieces}"  # one piece per word
        assert {"\u2581" + str(digit), "\u2581" + DIGIT_WORDS[digit]} & set(pieces)


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


def test_judge_heldout_accuracy_clean_and_augmented() -> None:
    judge = load_judge()
    assert judge_accuracy(judge) >= JUDGE_HELDOUT_FLOOR
    assert judge_accuracy(judge, augmented=True) >= JUDGE_AUGMENTED_FLOOR
    assert not any(p.requires_grad for p in judge.parameters())


def test_judge_is_independent_of_the_training_classifier() -> None:
    """Another model family (convolutional vs dense), other input (16x16 pixels vs 8x8 sklearn scale), own weights."""
    judge, classifier = load_judge(), load_classifier()
    assert isinstance(judge, DigitJudge) and isinstance(classifier, DigitClassifier)
    assert any(isinstance(m, torch.nn.Conv2d) for m in judge.modules())
    assert not any(isinstance(m, torch.nn.Conv2d) for m in classifier.modules())
    assert judge.features[0].in_channels == 1 and classifier.net[0].in_features == 64
    judge_shapes = {tuple(p.shape) for p in judge.parameters()}
    assert not judge_shapes & {tuple(p.shape) for p in classifier.parameters() if p.ndim > 1}
    # They fail differently: the judge was trained on shifted/blurred digits, the classifier was not (on seed 3 the
    # shipped pair scores about 0.95 vs 0.5 on these).
    images, labels = load_split("heldout")
    x = augment(upsample_digits(images) * 0.5 + 0.5, torch.Generator().manual_seed(3))
    u8 = (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).expand(-1, -1, -1, 3)
    judge_acc = float((judge.predict_proba_images(u8).argmax(-1) == labels).float().mean())
    classifier_acc = float((classifier.predict_proba_images(u8).argmax(-1) == labels).float().mean())
    assert judge_acc >= JUDGE_AUGMENTED_FLOOR and judge_acc - classifier_acc > 0.2


def test_judge_training_is_deterministic() -> None:
    a, b = train_judge(seed=5, epochs=1), train_judge(seed=5, epochs=1)
    c = train_judge(seed=6, epochs=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_augment_shifts_within_bounds_and_is_seeded() -> None:
    x = torch.zeros(4, 1, 16, 16)
    x[:, :, 7, 7] = 1.0  # one bright pixel
    a, b = augment(x, torch.Generator().manual_seed(0)), augment(x, torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    peaks = [divmod(int(img.flatten().argmax()), 16) for img in a]
    assert all(5 <= r <= 9 and 5 <= c <= 9 for r, c in peaks)  # moved by at most MAX_SHIFT = 2 pixels
    assert len(set(peaks)) > 1 or not torch.equal(a[0], a[1])


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


def test_judge_reward_scores_the_requested_digit() -> None:
    judge = DigitJudgeReward()
    judge.setup(torch.device("cpu"))
    images, labels = load_split("heldout")
    imgs = digits_to_uint8_rgb(images[:24])
    prompts = [f"the numeral {DIGIT_WORDS[int(d)]}" for d in labels[:24]]
    right = judge.score(imgs, prompts, [{} for _ in prompts])
    assert right.shape == (24,) and float(right.mean()) > 0.8
    assert float(right.min()) >= 0.0 and float(right.max()) <= 1.0
    single = torch.cat([judge.score(imgs[i : i + 1], prompts[i : i + 1], [{}]) for i in range(3)])
    assert torch.allclose(right[:3], single, atol=1e-6)
    wrong = judge.score(imgs, prompts, [{"digit": (int(d) + 1) % 10} for d in labels[:24]])
    assert float(wrong.mean()) < 0.2
    # Another size is resized, not rejected (32x32 nearest-upsampled digits score the same way).
    big = imgs.repeat_interleave(2, dim=1).repeat_interleave(2, dim=2)
    assert float(judge.score(big, prompts, [{} for _ in prompts]).mean()) > 0.8
    with pytest.raises(ValueError, match="digit-judge: cannot tell"):
        judge.score(imgs[:1], ["a cat"], [{}])


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
