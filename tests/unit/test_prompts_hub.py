"""Hub-dataset prompt sources (``hf-dataset`` with an ``owner/name`` id): found in a locally built Hugging Face cache
(real data files in the layout ``hf_hub_download`` leaves, under a scratch cache directory), checked offline without
downloading, and replaced by a local file through ``path``."""

from __future__ import annotations

import http.server
import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpost.components.hub_prompts import HFDatasetPrompts, _file_columns
from tests.weights_standins import hub_dataset_standin

TRAIN = [
    {"prompt": "a cat on a sofa", "human_preference": [1, 0]},
    {"prompt": "a cat on a sofa", "human_preference": [0, 1]},
    {"prompt": "a lighthouse at dusk", "human_preference": [1, 0]},
    {"prompt": "a red bicycle", "human_preference": [0, 1]},
]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A scratch hub cache (huggingface_hub reads HF_HUB_CACHE on import, so the constant is pointed at it), offline."""
    import huggingface_hub.constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_cached_hub_files_validate_and_load_offline(hub_cache):
    hub_dataset_standin(hub_cache, "ymhao/HPDv2", {"train.json": json.dumps(TRAIN)})
    source = HFDatasetPrompts("ymhao/HPDv2", data_files="train.json", unique=True)
    assert source.validate(None) == []
    rows = source.load()
    assert [p for p, _ in rows] == ["a cat on a sofa", "a lighthouse at dusk", "a red bicycle"]
    assert rows[0][1] == {"human_preference": [1, 0]}  # the first record of a repeated prompt
    assert len(HFDatasetPrompts("ymhao/HPDv2", data_files="train.json").load()) == 4  # unique off: every record
    limited = HFDatasetPrompts("ymhao/HPDv2", data_files="train.json", unique=True, limit=2).load()
    assert [p for p, _ in limited] == ["a cat on a sofa", "a lighthouse at dusk"]


def test_cached_benchmark_lists_of_strings_are_prompts(hub_cache):
    """HPD v2's benchmark files are JSON lists of strings: read as prompts, in data_files order, whatever the column."""
    files = {"benchmark/anime.json": json.dumps(["an anime fox", "a mecha"]), "benchmark/photo.json": '["a dock"]'}
    hub_dataset_standin(hub_cache, "zhwang/HPDv2", files)
    source = HFDatasetPrompts("zhwang/HPDv2", data_files=sorted(files))
    assert source.validate(None) == []
    assert source.load() == [("an anime fox", {}), ("a mecha", {}), ("a dock", {})]


def test_cached_jsonl_csv_and_parquet_hub_files(hub_cache, tmp_path):
    snapshot = hub_dataset_standin(
        hub_cache,
        "someone/prompts",
        {"a.jsonl": '{"prompt": "x", "k": 1}\n{"prompt": "y", "k": 2}\n', "b.csv": "prompt\nz\n"},
    )
    pq.write_table(pa.table({"prompt": ["w"], "k": [3]}), snapshot / "c.parquet")
    source = HFDatasetPrompts("someone/prompts", data_files=["a.jsonl", "b.csv", "c.parquet"])
    assert source.validate(None) == []
    assert source.load() == [("x", {"k": 1}), ("y", {"k": 2}), ("z", {}), ("w", {"k": 3})]
    for name in ("a.jsonl", "b.csv", "c.parquet"):
        problem = HFDatasetPrompts("someone/prompts", data_files=name, column="caption").validate(None)
        assert problem and problem[0].startswith(f"prompts.init_args.column: {name} has no column 'caption'")


def test_cached_file_without_the_column_is_a_validation_problem(hub_cache):
    hub_dataset_standin(hub_cache, "ymhao/HPDv2", {"train.json": json.dumps(TRAIN)})
    problems = HFDatasetPrompts("ymhao/HPDv2", data_files="train.json", column="caption").validate(None)
    assert problems == [
        "prompts.init_args.column: train.json has no column 'caption' (columns: ['prompt', 'human_preference']) "
        "(dataset 'ymhao/HPDv2')"
    ]


def test_offline_and_not_cached_says_what_and_how(hub_cache):
    problems = HFDatasetPrompts("ymhao/HPDv2", data_files="train.json").validate(None)
    assert len(problems) == 1
    assert problems[0].startswith(
        f"prompts.init_args.data_files: train.json of dataset 'ymhao/HPDv2' is not in the local Hugging Face cache "
        f"({hub_cache}) and offline mode is on"
    )
    assert "fetch it with `hf download ymhao/HPDv2 train.json --repo-type dataset`" in problems[0]
    assert "run once with network access" not in problems[0] and "--prompts.path FILE" in problems[0]
    # A hub id without data_files is looked up through datasets' own cache; not there either.
    whole = HFDatasetPrompts("nobody-xyz/not-cached").validate(None)
    assert len(whole) == 1 and whole[0].startswith("prompts.init_args.path: nobody-xyz/not-cached is not in the local")


def test_offline_load_of_uncached_files_fails_clearly(hub_cache):
    with pytest.raises(ValueError, match=r"train.json of dataset 'ymhao/HPDv2' is not in the local Hugging Face"):
        HFDatasetPrompts("ymhao/HPDv2", data_files="train.json").load()


@pytest.fixture
def empty_hub():
    """A local HTTP endpoint that answers 404 to everything: a hub without the requested dataset."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        do_HEAD = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_first_fetch_announces_itself_and_a_failed_fetch_is_clear(hub_cache, monkeypatch, capsys, empty_hub):
    """Online, an uncached file is fetched with a line saying so (the CLI hides the hub's progress bars); a hub
    that does not have it gives one clear error naming the file and the dataset."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", empty_hub)  # both are read from HF_ENDPOINT on import
    monkeypatch.setattr(
        huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", empty_hub + "/{repo_id}/resolve/{revision}/{filename}"
    )
    with pytest.raises(ValueError, match=r"could not fetch 'train.json' of hub dataset 'ymhao/HPDv2'"):
        HFDatasetPrompts("ymhao/HPDv2", data_files="train.json").load()
    assert f"fetching prompts ymhao/HPDv2/train.json (first use, cached in {hub_cache})" in capsys.readouterr().err


def test_online_uncached_hub_files_are_left_to_the_first_load(hub_cache, monkeypatch):
    """With network access validation does not download: an uncached hub file is fetched when the run loads it."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert HFDatasetPrompts("ymhao/HPDv2", data_files="train.json").validate(None) == []
    assert list(hub_cache.iterdir()) == []  # nothing fetched


def test_unsupported_hub_file_type(hub_cache):
    problems = HFDatasetPrompts("ymhao/HPDv2", data_files="train.tar.gz").validate(None)
    assert problems and problems[0].startswith("prompts.init_args.data_files: 'train.tar.gz': unsupported file type")


def test_local_file_as_path_replaces_the_hub_dataset(tmp_path, hub_cache):
    """``--prompts.path FILE`` on a hub-dataset recipe: the file is read, the recipe's data_files do not apply."""
    (tmp_path / "p.txt").write_text("a cat\na cat\na dog\n")
    source = HFDatasetPrompts(str(tmp_path / "p.txt"), data_files="train.json", unique=True)
    assert source.validate(None) == []
    assert source.load() == [("a cat", {}), ("a dog", {})]
    missing = HFDatasetPrompts(str(tmp_path / "none.txt"), data_files="train.json").validate(None)
    assert missing == [f"prompts.init_args.path: prompt file not found: {tmp_path / 'none.txt'}"]
    pq.write_table(pa.table({"caption": ["x", "y"]}), tmp_path / "p.parquet")
    assert "has no column 'prompt'" in HFDatasetPrompts(str(tmp_path / "p.parquet")).validate(None)[0]
    assert HFDatasetPrompts(str(tmp_path / "p.parquet"), column="caption").load() == [("x", {}), ("y", {})]


def test_json_array_columns_from_the_head_only(tmp_path):
    objects = tmp_path / "o.json"
    objects.write_text(json.dumps([{"prompt": "a", "x": 1}] + [{"prompt": "b" * 100}] * 2000))
    assert _file_columns(objects, "json") == ["prompt", "x"]
    strings = tmp_path / "s.json"
    strings.write_text(json.dumps(["a", "b"]))
    assert _file_columns(strings, "json") == ["text"]
    huge_first = tmp_path / "h.json"
    huge_first.write_text(json.dumps([{"prompt": "z" * 200_000}]))
    assert _file_columns(huge_first, "json") is None  # not decidable from the head: left to loading
