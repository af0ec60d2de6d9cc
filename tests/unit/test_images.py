"""Sample-grid captions (rlpost.ops.images): wrapped between words, numbers never split across lines."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from PIL import Image

from rlpost.ops.images import _CAPTION_LINES, _LINE_H, _wrap, save_grid

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
WIDTH = 128  # one upscaled tile: 21 characters a line


def _numbers_intact(caption: str, lines: list[str]) -> None:
    """The numbers read from the lines (joined by spaces) are the caption's, in order (a prefix when it was cut)."""
    shown, original = _NUMBER.findall(" ".join(lines)), _NUMBER.findall(caption)
    assert shown == original[: len(shown)], (caption, lines)
    if not lines[-1].endswith("…"):
        assert shown == original, (caption, lines)


def test_caption_that_used_to_split_a_reward_keeps_it_on_one_line() -> None:
    # 21 characters a line: the old fixed-width slicing cut this after "r=0." and put "734" on the next line.
    caption = "a photo of two cats r=0.734 at step 12"
    lines = _wrap(caption, WIDTH)
    assert "r=0.734" in " ".join(lines).split() and any("r=0.734" in line for line in lines), lines
    assert any(line.endswith("step 12") or "step 12" in line for line in lines), lines
    _numbers_intact(caption, lines)
    assert all(len(line) <= 21 for line in lines)


def test_many_captions_never_split_a_number() -> None:
    prompts = ["a red cube", "the handwritten number 7 drawn in ink", "two cats on a mat", "a photo of a dog"]
    for prompt in prompts:
        for value in (0.734, 12.5, 0.0001234, 123456.75):
            for fmt in ("{p} | r={v:.3g}", "{p} | r={v}", "before step 12 r={v:.2f}\n{p}"):
                caption = fmt.format(p=prompt, v=value)
                lines = _wrap(caption, WIDTH)
                assert 1 <= len(lines) <= _CAPTION_LINES
                _numbers_intact(caption, lines)


def test_long_caption_is_cut_after_a_whole_word_and_newline_starts_a_line() -> None:
    caption = "after step 40 r=0.91\n" + "a very long prompt about 3 red cubes and 4 blue spheres on 12 tables"
    lines = _wrap(caption, WIDTH)
    _numbers_intact(caption, lines)
    assert lines[0] == "after step 40 r=0.91"
    assert len(lines) == _CAPTION_LINES and lines[-1].endswith("…")
    kept = lines[-1].removesuffix("…").split()
    words = caption.split()
    assert all(w in words for w in kept), lines  # no word (or number) was halved before the ellipsis


def test_digit_free_overlong_word_is_still_cut_to_fit() -> None:
    lines = _wrap("x" * 50, WIDTH)
    assert all(len(line) <= 21 for line in lines)


def test_grid_size_unchanged(tmp_path: Path) -> None:
    images = torch.zeros(3, 32, 32, 3, dtype=torch.uint8)
    path = save_grid(images, ["a photo of two cats r=0.734 at step 12"] * 3, tmp_path / "g.png")
    assert Image.open(path).size == (2 * WIDTH, 2 * (WIDTH + _CAPTION_LINES * _LINE_H + 4))
