"""Wan2.1 text-to-video through the unchanged seam: every algorithm's tiny recipe trains two steps on the tiny Wan
with the reward scoring frames (reduced per ``reward_frames``), the TreeGRPO run's held-out evaluation writes stacked
PNGs and GIFs and its report frame strips and before/after GIFs, an exported Wan LoRA loads with
``WanPipeline.load_lora_weights`` and reproduces the run's held-out videos and ``rlpost sample``, and bad video
recipes fail ``rlpost validate`` naming the field before any weight loads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import yaml
from PIL import Image, ImageSequence

import rlpost.models.wan as wan_module
from rlpost.apps import cli
from rlpost.apps.host import build_host
from rlpost.core.api import RewardSource
from rlpost.core.contract import PromptBatch
from rlpost.core.hookspecs import hookimpl
from rlpost.engine.guards import GuardConfig, Guards
from rlpost.engine.recipe import validate
from rlpost.engine.scoring import score_rollout
from rlpost.ops.images import STRIP_FRAMES, frame_strip
from rlpost_rewards.jpeg import JpegCompressibility
from tests.models_fixtures_wan import *  # noqa: F403  (the fixtures tiny_wan_dir, make_wan_policy)
from tests.models_fixtures_wan import WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH
from tests.tolerances import assert_pixels_close
from tests.unit.components.chain_helpers import check_end_to_end, train_two_iterations

ROOT = Path(__file__).resolve().parents[3]
TREE = "recipes/tiny/treegrpo_wan.yaml"
ALGORITHMS = {
    "treegrpo": TREE,
    "dancegrpo": "recipes/tiny/dancegrpo_wan.yaml",
    "mixgrpo": "recipes/tiny/mixgrpo_wan.yaml",
    "ddpo": "recipes/tiny/ddpo_wan.yaml",
    "tempflow": "recipes/tiny/tempflow_wan.yaml",
    "branchgrpo": "recipes/tiny/branchgrpo_wan.yaml",
    "flowgrpo": "recipes/tiny/flowgrpo_wan.yaml",
    "flowgrpo_fast": "recipes/tiny/flowgrpo_fast_wan.yaml",
    "grpo_guard": "recipes/tiny/grpo_guard_wan.yaml",
    "treenft": "recipes/tiny/treenft_wan.yaml",
}
EVAL_PROMPTS = ["a yellow star", "a purple ring"]  # recipes/tiny/treegrpo_wan.yaml's eval section
EVAL_SEED, EVAL_STEPS = 5, 3


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the recipes are named relative to the repository root


def _recipe(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / name).read_text()))


def _reduce(raw: torch.Tensor, reduction: str, videos: int) -> torch.Tensor:
    """The documented reduction (docs/rewards.md "Video") of a call's raw frame scores, written out here."""
    if reduction == "first":
        return raw  # one score per video: its first frame's
    per_video = raw.reshape(videos, WAN_FRAMES)
    return per_video.mean(1) if reduction == "mean" else per_video.min(1).values


class _ScoreSpy:
    """Records what the real JPEG-compressibility reward is called with and returns (it still scores)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[tuple[int, ...], int, torch.Tensor]] = []
        real = JpegCompressibility.score

        def score(reward: Any, images: torch.Tensor, prompts: list[str], metadata: list[Any]) -> torch.Tensor:
            out = real(reward, images, prompts, metadata)
            if reward.name == JpegCompressibility.name:  # not the eval judge (a subclass)
                self.calls.append((tuple(images.shape), len(prompts), out.clone()))
            return out

        monkeypatch.setattr(JpegCompressibility, "score", score)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_two_steps_on_tiny_wan(
    algorithm: str, tiny_wan_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two steps of each algorithm on the tiny Wan: the reward gets frames (or each video's first frame), the logged
    reward is the documented reduction of those frame scores, metrics are finite, weights move, a LoRA checkpoint
    is written."""
    recipe = ALGORITHMS[algorithm]
    cfg = _recipe(recipe)
    assert cfg["model"]["class_path"] == "wan"
    reduction = (cfg.get("reward_frames") or {}).get("reduction", "mean")
    videos = cfg["run"]["groups_per_step"] * cfg["run"].get("samples_per_group", 1)
    if algorithm in ("treegrpo", "treenft"):
        videos *= cfg["sampler"]["init_args"]["k"] ** cfg["sampler"]["init_args"]["depth"]  # leaves per prompt
    if algorithm == "tempflow":
        comb = cfg["sampler"]["init_args"]  # trunks x k children at each of the first T-1 steps, per prompt
        videos = cfg["run"]["groups_per_step"] * comb["trunks_per_prompt"] * comb["k"] * (comb["num_steps"] - 1)
    if algorithm == "branchgrpo":
        videos *= cfg["sampler"]["init_args"]["num_splits"] ** len(cfg["sampler"]["init_args"]["split_points"])
    spy = _ScoreSpy(monkeypatch)
    lines, probe = train_two_iterations(recipe, tiny_wan_dir, tmp_path / "run")
    check_end_to_end(lines, probe)  # finite metrics, ratio 1 before the first update, weights moved
    stored = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    assert stored["model"]["class_path"] == "rlpost.models.wan.WanPolicy"  # the run really used Wan
    assert stored["model"]["init_args"]["pretrained"] == str(tiny_wan_dir)
    assert stored["reward_frames"] == {"reduction": reduction}
    per_call = videos if reduction == "first" else videos * WAN_FRAMES
    train_calls = [c for c in spy.calls if c[1] == per_call]
    assert len(train_calls) == 2, [c[0] for c in spy.calls]  # one scoring call per step (evaluation calls differ)
    for line, (shape, _, raw) in zip(lines, train_calls, strict=True):
        assert shape == (per_call, WAN_HEIGHT, WAN_WIDTH, 3)  # frames, as images
        assert line["perf/images"] == videos
        expected = float(_reduce(raw, reduction, videos).mean())
        assert line["reward/jpeg-compressibility"] == pytest.approx(expected, rel=1e-6)
    lora = tmp_path / "run" / "checkpoints" / f"step_{2:06d}" / "lora" / "pytorch_lora_weights.safetensors"
    assert lora.is_file()
    if algorithm == "dancegrpo":
        # 2 groups x 4 samples x 4 steps, CFG rows counted once; 3 SDE steps trained per sample.
        assert lines[0]["perf/rollout_forwards"] == 2 * 4 * 4
        assert lines[0]["train/edges"] == 2 * 4 * 3


def test_frame_reductions_rescore_a_wan_rollout_as_documented(tiny_wan_dir: Path) -> None:
    """One tiny-Wan rollout scored by the engine's scoring with each ``reward_frames.reduction``: mean, min and first
    are the mean, the minimum and frame 0 of the per-frame scores of the same frames, and they differ."""
    host = build_host()
    cfg = _recipe(ALGORITHMS["ddpo"])
    cfg["model"]["init_args"]["pretrained"] = str(tiny_wan_dir)
    recipe = validate(cfg, host)
    recipe.model.setup(torch.device("cpu"))
    batch = PromptBatch(["a photo of a cat", "a red car"], [{}, {}], samples_per_group=2)
    with torch.no_grad():
        rollout = recipe.sampler.rollout(recipe.model, batch, torch.Generator().manual_seed(0))
    media = rollout.media
    assert media.shape == (4, WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH, 3)
    reward = JpegCompressibility()
    frames = reward.score(media.flatten(0, 1), ["p"] * (4 * WAN_FRAMES), [{}] * (4 * WAN_FRAMES))
    per_frame = frames.reshape(4, WAN_FRAMES)
    assert per_frame.std(1).min() > 0  # the frames differ, so the reductions can
    got = {}
    for reduction in ("mean", "min", "first"):
        guards = Guards(GuardConfig())
        scores = score_rollout([reward], {reward.name: 1.0}, rollout, guards, host, reduction)  # type: ignore[arg-type]
        got[reduction] = scores.scores[reward.name]
        assert not guards.problems
    torch.testing.assert_close(got["mean"], per_frame.mean(1))
    torch.testing.assert_close(got["min"], per_frame.min(1).values)
    torch.testing.assert_close(got["first"], per_frame[:, 0])
    assert (got["min"] < got["mean"]).all() and (got["first"] - got["mean"]).abs().max() > 1e-3


# ------------------------------------------------------------------------------ eval, report, export, sample


@pytest.fixture(scope="module")
def wan_lora_run(tmp_path_factory: pytest.TempPathFactory, tiny_wan_dir: Path) -> Iterator[Path]:
    """The tiny TreeGRPO Wan recipe, trained two steps through ``rlpost train`` with CFG on and a learning rate large
    enough that the LoRA visibly changes the held-out videos, logging to TensorBoard with a sample grid every step."""
    from rlpost.apps.host import reset_host

    out = tmp_path_factory.mktemp("wan-export") / "run"
    reset_host(build_host())
    try:
        rc = cli.main(
            [
                "train", "--recipe", str(ROOT / TREE), "--model.pretrained", str(tiny_wan_dir),
                "--model.guidance_scale", "5.0", "--torch_optimizer.init_args.lr", "0.05",
                "--run.output_dir", str(out), "--logging.report_to", "[tensorboard]", "--logging.grid_every", "1",
            ]
        )  # fmt: skip
    finally:
        reset_host(None)
    assert rc == 0
    yield out


def _png_frames(path: Path) -> np.ndarray:
    """A saved sample PNG (frames stacked top to bottom) as ``[F, H, W, 3]``."""
    stacked = np.asarray(Image.open(path).convert("RGB"))
    assert stacked.shape == (WAN_FRAMES * WAN_HEIGHT, WAN_WIDTH, 3)
    return stacked.reshape(WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH, 3)


def _gif_frames(path: Path) -> np.ndarray:
    with Image.open(path) as gif:
        return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(gif)])


def _eval_videos(run: Path, step: int) -> list[np.ndarray]:
    return [_png_frames(run / "eval" / f"step_{step:06d}" / f"{i:04d}.png") for i in range(len(EVAL_PROMPTS))]


def test_eval_writes_stacked_pngs_and_gifs_scored_per_frame(wan_lora_run: Path) -> None:
    """Each held-out video is a PNG of its 9 frames stacked top to bottom plus a 9-frame GIF of the same frames;
    eval.jsonl records the frame count, and each prompt's reward is the mean of its frames' scores, recomputed
    here from the lossless PNGs."""
    evals = [json.loads(line) for line in (wan_lora_run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and all(e["frames"] == WAN_FRAMES for e in evals)
    reward = JpegCompressibility()
    for record in evals:
        videos = _eval_videos(wan_lora_run, record["step"])
        for i, (video, row) in enumerate(zip(videos, record["per_prompt"], strict=True)):
            assert row["prompt"] == EVAL_PROMPTS[i] and row["seed"] == EVAL_SEED + i
            gif = _gif_frames(wan_lora_run / "eval" / f"step_{record['step']:06d}" / f"{i:04d}.gif")
            assert gif.shape == video.shape
            # GIF keeps at most 256 colours per frame: close to the exact PNG pixels, not equal.
            assert np.abs(gif.astype(int) - video.astype(int)).mean() < 4
            frames = reward.score(torch.from_numpy(video), [row["prompt"]] * WAN_FRAMES, [{}] * WAN_FRAMES)
            assert row["jpeg-compressibility"] == pytest.approx(float(frames.mean()), rel=1e-6)
            assert float(frames.min()) < row["jpeg-compressibility"]  # min would score differently
    assert any(float(np.abs(a[1:].astype(int) - a[:1]).max()) > 0 for a in _eval_videos(wan_lora_run, 0))


def test_tensorboard_receives_the_samples_as_video(wan_lora_run: Path) -> None:
    """TensorBoard gets each step's samples and each evaluation's set as video (an animated GIF of every frame, the
    summary SummaryWriter.add_video writes), the bytes of the GIF grid written beside the PNG grid."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(wan_lora_run / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    for tag, steps, folder in (("samples/video", [1, 2], "grids"), ("eval/video", [0, 2], "eval")):
        events = acc.Images(tag)
        assert [e.step for e in events] == steps, tag
        for event in events:
            on_disk = wan_lora_run / folder / f"step_{event.step:06d}.gif"
            assert event.encoded_image_string == on_disk.read_bytes()
            frames = _gif_frames(on_disk)
            assert frames.shape[0] == WAN_FRAMES and (event.height, event.width) == frames.shape[1:3]
            assert np.abs(frames[1:].astype(int) - frames[:1]).max() > 0  # it moves: a video, not a still
    assert [e.step for e in acc.Images("samples/grid")] == [1, 2]  # the frame-strip PNG grid as before


def test_report_shows_frame_strips_and_before_after_gifs(wan_lora_run: Path) -> None:
    """report/before_after.png's tiles are the held-out videos' frame strips (4 evenly spaced frames side by side),
    and report/before_after/*.gif plays each prompt's first-evaluation clip left of its last-evaluation clip."""
    before, after = _eval_videos(wan_lora_run, 0), _eval_videos(wan_lora_run, 2)
    grid = np.asarray(Image.open(wan_lora_run / "report" / "before_after.png").convert("RGB"))
    tile_w = STRIP_FRAMES * WAN_WIDTH  # tiles of 192 x 32 px are not upscaled (rlpost/ops/images.py _MIN_CELL)
    assert grid.shape[1] == 2 * len(EVAL_PROMPTS) * tile_w and grid.shape[0] > WAN_HEIGHT
    tiles = [grid[:WAN_HEIGHT, j * tile_w : (j + 1) * tile_w] for j in range(2 * len(EVAL_PROMPTS))]
    for i in range(len(EVAL_PROMPTS)):  # before, after, before, after
        assert np.array_equal(tiles[2 * i], frame_strip(torch.from_numpy(before[i])).numpy())
        assert np.array_equal(tiles[2 * i + 1], frame_strip(torch.from_numpy(after[i])).numpy())
    gifs = sorted((wan_lora_run / "report" / "before_after").glob("*.gif"))
    assert [g.name for g in gifs] == [f"eval_{i:03d}.gif" for i in range(len(EVAL_PROMPTS))]
    for i, path in enumerate(gifs):
        gif = _gif_frames(path)
        assert gif.shape == (WAN_FRAMES, WAN_HEIGHT, 2 * WAN_WIDTH, 3)
        side_by_side = np.concatenate([before[i], after[i]], axis=2)
        assert np.abs(gif.astype(int) - side_by_side.astype(int)).mean() < 4
    summary = json.loads((wan_lora_run / "report" / "summary.json").read_text())
    assert "report/before_after/eval_000.gif" in summary["files"]


def test_exported_wan_lora_loads_and_reproduces_eval_and_sample(
    wan_lora_run: Path, tiny_wan_dir: Path, tmp_path: Path
) -> None:
    """`rlpost export` writes a text-to-video model card naming the base model and a LoRA that
    ``WanPipeline.load_lora_weights`` loads; the pipeline then renders the run's last held-out videos, and `rlpost
    sample` renders them again, each within one level per channel (tests/tolerances.py PIXEL_ATOL)."""
    from diffusers import DiffusionPipeline, WanPipeline
    from huggingface_hub import ModelCard

    from rlpost.apps.host import reset_host

    run = wan_lora_run
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "export")]) == 0
    card = ModelCard.load(tmp_path / "export" / "README.md")
    assert card.data.pipeline_tag == "text-to-video"
    # A local base is no Hub id: left out of the metadata, named in the usage snippet.
    assert card.data.base_model is None and f'from_pretrained("{tiny_wan_dir.resolve()}")' in card.text
    assert {"text-to-video", "lora", "wan"} <= set(card.data.tags)
    assert "DiffusionPipeline.from_pretrained" in card.text and "load_lora_weights" in card.text
    # The snippet samples with the run's evaluation settings: the call this test makes below.
    settings = f"num_inference_steps={EVAL_STEPS}, guidance_scale=5.0, height={WAN_HEIGHT}, width={WAN_WIDTH}"
    assert f"frames = pipe(prompt, {settings}, num_frames={WAN_FRAMES}" in card.text
    # Follow the card: DiffusionPipeline resolves WanPipeline from model_index.json.
    pipe = DiffusionPipeline.from_pretrained(str(tiny_wan_dir), torch_dtype=torch.float32)
    assert isinstance(pipe, WanPipeline)
    pipe.set_progress_bar_config(disable=True)

    def render(i: int) -> np.ndarray:
        video = pipe(
            EVAL_PROMPTS[i], num_inference_steps=EVAL_STEPS, guidance_scale=5.0, height=WAN_HEIGHT, width=WAN_WIDTH,
            num_frames=WAN_FRAMES, max_sequence_length=32, generator=torch.Generator().manual_seed(EVAL_SEED + i),
            output_type="np",
        ).frames[0]  # fmt: skip
        return np.asarray((video * 255).round().astype(np.uint8))

    trained, before = _eval_videos(run, 2), _eval_videos(run, 0)
    base = [render(i) for i in range(len(EVAL_PROMPTS))]
    for b, first in zip(base, before, strict=True):
        assert_pixels_close(b, first)  # the pipeline without the LoRA renders the step-0 evaluation
    change = max(int(np.abs(a.astype(int) - b.astype(int)).max()) for a, b in zip(trained, before, strict=True))
    assert change > 8, "training must change the held-out videos"
    pipe.load_lora_weights(str(tmp_path / "export"))
    for i, expected in enumerate(trained):
        assert_pixels_close(render(i), expected)
    # rlpost sample rebuilds the Wan policy from the run's recipe and renders the same videos (PNG + GIF each).
    reset_host(build_host())
    try:
        args = ["sample", "--run", str(run), "--out", str(tmp_path / "s"), "--num-steps", str(EVAL_STEPS)]
        prompts = [a for p in EVAL_PROMPTS for a in ("--prompt", p)]
        assert cli.main([*args, "--seed", str(EVAL_SEED), *prompts]) == 0
    finally:
        reset_host(None)
    for i, expected in enumerate(trained):
        assert_pixels_close(_png_frames(tmp_path / "s" / f"{i:04d}.png"), expected)
        assert _gif_frames(tmp_path / "s" / f"{i:04d}.gif").shape == expected.shape


# ----------------------------------------------------------------------------------------------- bad input


class _StillImageReward(RewardSource):
    """A reward that declares per-frame scores meaningless (``media_scope = "image"``)."""

    name: ClassVar[str] = "test-still-image"
    media_scope: ClassVar[Any] = "image"

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> torch.Tensor:
        return images.float().mean(dim=(1, 2, 3))


class _StillImagePlugin:
    @hookimpl
    def rlpost_register_reward_sources(self, register: Any) -> None:
        register(_StillImageReward)


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"rewards": [{"class_path": "test-still-image"}]}, "rewards[0]", "scores single images only"),
        ({"eval.judges": [{"class_path": "test-still-image"}]}, "eval.judges[0]", "scores single images only"),
        ({"model.num_frames": 8}, "model.init_args.num_frames", "need num_frames = 1 (mod 4), e.g. 5 or 9"),
        ({"model.height": 30}, "model.init_args.height", "30 is not a multiple of 16"),
        ({"model.width": 50}, "model.init_args.width", "50 is not a multiple of 16"),
    ],
    ids=["image-reward", "image-judge", "frames", "height", "width"],
)
def test_validate_names_the_bad_video_field_before_loading(
    change: dict[str, Any], field: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """`rlpost validate` and `rlpost train` on the tiny Wan TreeGRPO recipe with one bad field exit 2 naming it;
    nothing is loaded or built (from_pretrained and the tiny build fail the test) and nothing is written."""
    from diffusers import WanPipeline

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("validation must not load weights")

    monkeypatch.setattr(WanPipeline, "from_pretrained", no_loading)
    monkeypatch.setattr(wan_module, "ensure_tiny_wan", no_loading)
    monkeypatch.setenv("RLPOST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RLPOST_VERBOSE", "1")  # train would otherwise set progress-bar variables for later tests
    host = build_host(extra_plugins=(_StillImagePlugin(),))
    monkeypatch.setattr(cli, "get_host", lambda: host)
    cfg = _recipe(TREE)
    cfg["run"]["output_dir"] = str(tmp_path / "run")
    for key, value in change.items():
        section, name = key.split(".") if "." in key else (key, None)
        if name is None:
            cfg[section] = value
        elif section == "model":
            cfg["model"]["init_args"][name] = value
        else:
            cfg[section][name] = value
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    for command in ("validate", "train"):
        assert cli.main([command, "--recipe", str(recipe)]) == 2
        err = capsys.readouterr().err
        assert f"{field}:" in err and message in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
