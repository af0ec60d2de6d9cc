"""Remote reward: a local server on 127.0.0.1 (random free port) in a thread, JSON + base64 PNG round trips."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from rlpost_rewards.jpeg import JpegIncompressibility
from rlpost_rewards.remote import RemoteReward, RemoteRewardError
from rlpost_rewards.server import builtin_rewards, make_server
from rlpost_rewards.threaded import ThreadedScorer

from .conftest import PROMPTS, make_images


class _EchoMeta(JpegIncompressibility):
    """Scores = JPEG kB + metadata['bonus'], to check prompts/metadata travel."""

    name = "echo-meta"

    def score(self, images, prompts, metadata):  # noqa: ANN001, ANN201
        assert len(prompts) == images.shape[0]
        return super().score(images, prompts, metadata) + torch.tensor([float(m.get("bonus", 0)) for m in metadata])


class _Broken(JpegIncompressibility):
    name = "broken"

    def score(self, images, prompts, metadata):  # noqa: ANN001, ANN201
        raise RuntimeError("model exploded")


def _serve(reward) -> Iterator[str]:  # noqa: ANN001
    server = make_server(reward, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def echo_url() -> Iterator[str]:
    yield from _serve(_EchoMeta())


def test_round_trip_matches_local(echo_url: str) -> None:
    remote = RemoteReward(url=echo_url, timeout_s=10, expect_reward="echo-meta")
    remote.setup(torch.device("cpu"))
    images = make_images(8, size=32)
    meta = [{"bonus": i, "path": object()} for i in range(8)]  # non-JSON values are sent as str()
    got = remote.score(images, PROMPTS, meta)
    local = JpegIncompressibility().score(images, PROMPTS, meta) + torch.arange(8).float()
    torch.testing.assert_close(got, local)  # PNG is lossless, so identical pixels reach the server
    assert got.dtype == torch.float32


def test_health_and_wrong_reward(echo_url: str) -> None:
    with urllib.request.urlopen(f"{echo_url}/health", timeout=5) as response:
        assert json.loads(response.read()) == {"status": "ok", "reward": "echo-meta"}
    with pytest.raises(RemoteRewardError, match="expected 'hps-v2.1'"):
        RemoteReward(url=echo_url, expect_reward="hps-v2.1").setup(torch.device("cpu"))


def test_server_errors_are_reported() -> None:
    for url in _serve(_Broken()):
        remote = RemoteReward(url=url, timeout_s=5, retries=1, backoff_s=0.01)
        remote.setup(torch.device("cpu"))
        with pytest.raises(RemoteRewardError, match="model exploded"):
            remote.score(make_images(1), ["x"], [{}])
        request = urllib.request.Request(f"{url}/score", data=b'{"images": ["not png"]}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=5)
        assert err.value.code == 400


def test_dead_server_fails_fast_with_clear_error() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = RemoteReward(url=f"http://127.0.0.1:{port}", timeout_s=1, retries=2, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"after 3 attempt\(s\).*rlpost_rewards.server"):
        remote.setup(torch.device("cpu"))
    assert time.monotonic() - start < 5


def test_threaded_scorer_overlaps_and_matches(echo_url: str) -> None:
    reward = JpegIncompressibility()
    images = make_images(4)
    with ThreadedScorer(reward) as scorer:
        future = scorer.submit(images, PROMPTS[:4], [{}] * 4)
        torch.testing.assert_close(future.result(timeout=10), reward.score(images, PROMPTS[:4], [{}] * 4))
    with ThreadedScorer(_Broken()) as scorer, pytest.raises(RuntimeError, match="exploded"):
        scorer.submit(images, PROMPTS[:4], [{}] * 4).result(timeout=10)


def test_builtin_table_and_registration() -> None:
    table = builtin_rewards()
    assert set(table) == {
        "jpeg-compressibility",
        "jpeg-incompressibility",
        "hps-v2.1",
        "clipscore",
        "aesthetic",
        "pickscore",
        "image-reward",
        "remote",
    }
    for name, cls in table.items():
        assert name == name.lower() and " " not in name and "_" not in name
        assert cls.kind == "reward" and "Args:" in (cls.__doc__ or "")
