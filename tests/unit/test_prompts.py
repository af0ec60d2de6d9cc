"""Prompt sources and the seeded, epoch-aware prompt stream."""

from __future__ import annotations

import json

import pytest

from rlpost.components.hub_prompts import HFDatasetPrompts
from rlpost.components.prompt_sources import PromptFile, PromptList
from rlpost.components.prompts import PromptStream


def test_text_jsonl_json_csv(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n\n a dog \n")
    assert PromptFile(str(tmp_path / "p.txt")).load() == [("a cat", {}), ("a dog", {})]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x", "digit": 3}) + "\n" + json.dumps({"prompt": "y"}))
    assert PromptFile(str(tmp_path / "p.jsonl")).load() == [("x", {"digit": 3}), ("y", {})]
    (tmp_path / "p.json").write_text(json.dumps(["u", {"prompt": "v", "style": "anime"}]))
    assert PromptFile(str(tmp_path / "p.json")).load() == [("u", {}), ("v", {"style": "anime"})]
    (tmp_path / "p.csv").write_text("prompt,style\nq,photo\n")
    assert PromptFile(str(tmp_path / "p.csv")).load() == [("q", {"style": "photo"})]
    assert PromptFile(str(tmp_path / "p.txt"), limit=1).load() == [("a cat", {})]


def test_malformed_jsonl_names_file_and_line(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"text": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:2: expected an object with a string field 'prompt'"):
        PromptFile(str(tmp_path / "p.jsonl")).load()


def test_validate_reports_missing_file_and_bad_suffix(tmp_path):
    assert "prompt file not found" in PromptFile(str(tmp_path / "none.txt")).validate(None)[0]
    (tmp_path / "p.xml").write_text("<a/>")
    assert "unsupported prompt file type" in PromptFile(str(tmp_path / "p.xml")).validate(None)[0]
    assert PromptList([]).validate(None) == ["prompts.init_args.prompts: the prompt list is empty"]


def test_hf_dataset_from_local_files(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text("\n".join(json.dumps({"prompt": p, "style": s}) for p, s in [("a", "anime"), ("b", "photo")]))
    rows = HFDatasetPrompts("json", data_files=str(path), split="train").load()
    assert rows == [("a", {"style": "anime"}), ("b", {"style": "photo"})]
    with pytest.raises(ValueError, match="no column 'text'"):
        HFDatasetPrompts("json", data_files=str(path), column="text").load()


def test_stream_is_seeded_and_covers_each_epoch():
    items = [(f"p{i}", {"i": i}) for i in range(5)]
    a, b = PromptStream(items, seed=3), PromptStream(items, seed=3)
    first = a.next_batch(5, samples_per_group=2)
    assert first.prompts == b.next_batch(5, 2).prompts
    assert sorted(first.prompts) == [f"p{i}" for i in range(5)]  # one epoch = every prompt once
    assert first.samples_per_group == 2 and first.metadata[0]["i"] == int(first.prompts[0][1:])
    second = a.next_batch(5, 2)
    assert sorted(second.prompts) == sorted(first.prompts) and a.epoch == 1
    assert PromptStream(items, seed=4).next_batch(5, 2).prompts != first.prompts


def test_stream_state_round_trip_crosses_epochs():
    items = [(f"p{i}", {}) for i in range(4)]
    s = PromptStream(items, seed=0)
    s.next_batch(3, 1)
    state = s.state_dict()
    expected = s.next_batch(6, 1).prompts
    t = PromptStream(items, seed=0)
    t.load_state_dict(state)
    assert t.next_batch(6, 1).prompts == expected


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_deeply_nested_json_prompts_are_a_problem_not_a_traceback(suffix, tmp_path):
    """Python's JSON decoder recurses per level and raised ``RecursionError`` through validation."""
    path = tmp_path / f"p{suffix}"
    path.write_text("[" * 100_000 + "\n")
    line = ":1" if suffix == ".jsonl" else ""  # JSON lines are named by line
    problem = f"prompts.init_args.path: {path}{line}: malformed JSON (nested too deeply)"
    assert PromptFile(str(path)).validate(None) == [problem]
    hub = HFDatasetPrompts(str(path)).validate(None)
    assert len(hub) == 1 and "nested too deeply" in hub[0] and str(path) in hub[0]


def test_a_prompt_file_is_read_within_its_bound(tmp_path, monkeypatch):
    import rlpost.components.prompt_sources as prompt_sources

    path = tmp_path / "p.txt"
    path.write_text("a cat\n" * 10)
    monkeypatch.setattr(prompt_sources, "MAX_PROMPT_FILE_BYTES", 59)
    assert PromptFile(str(path)).validate(None) == [
        f"prompts.init_args.path: {path}: larger than 59 bytes, the limit for a prompt file"
    ]
