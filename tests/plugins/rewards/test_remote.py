"""Remote reward: a local server on 127.0.0.1 (random free port) in a thread, JSON + base64 PNG round trips; the
client's deadline, error messages and strict answer schema against servers that misbehave."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlpost_rewards import remote as remote_module
from rlpost_rewards._wire import WireLimits
from rlpost_rewards.jpeg import JpegIncompressibility
from rlpost_rewards.remote import RemoteReward, RemoteRewardError
from rlpost_rewards.server import ServerLimits, builtin_rewards, make_server
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


def _serve(reward, **kwargs) -> Iterator[str]:  # noqa: ANN001
    server = make_server(reward, "127.0.0.1", 0, **kwargs)
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
        health = json.loads(response.read())
    assert (health["status"], health["reward"]) == ("ok", "echo-meta")
    assert health["limits"] == WireLimits().to_json()
    with pytest.raises(RemoteRewardError, match="expected 'hps-v2.1'"):
        RemoteReward(url=echo_url, expect_reward="hps-v2.1").setup(torch.device("cpu"))


def test_server_errors_are_reported() -> None:
    for url in _serve(_Broken()):
        remote = RemoteReward(url=url, timeout_s=5, retries=1, backoff_s=0.01)
        remote.setup(torch.device("cpu"))
        with pytest.raises(RemoteRewardError) as err:
            remote.score(make_images(1), ["x"], [{}])
        # The server's own message, and no "is it running?" after it clearly answered.
        assert "HTTP 500: scoring failed: RuntimeError: model exploded" in str(err.value)
        assert "Is it running" not in str(err.value)
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
    with pytest.raises(RemoteRewardError, match=r"after 3 attempt\(s\).*rlpost_rewards.server") as err:
        remote.setup(torch.device("cpu"))
    assert time.monotonic() - start < 20  # refused at once; generous for a loaded machine
    message = str(err.value)  # one line naming the URL: what a training run prints when its server is down
    assert f"reward server http://127.0.0.1:{port}/health" in message and "ConnectionRefusedError" in message
    assert "\n" not in message


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


# ------------------------------------------------------------------------------------------- hostile servers


class _Canned(BaseHTTPRequestHandler):
    """Answers every request with the class's ``status`` and ``body`` (set per test through a subclass)."""

    protocol_version = "HTTP/1.1"
    status = 200
    body = b"{}"

    def log_message(self, format, *args):  # noqa: A002, ANN001, ANN002, ANN201
        pass

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_POST = _answer  # noqa: N815


@contextmanager
def _canned(status: int, body: bytes) -> Iterator[str]:
    handler = type("Handler", (_Canned,), {"status": status, "body": body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[1.0]", "answered list, expected a JSON object"),
        (b"not json", "not JSON"),
        (b'{"scores": [true, false]}', "not finite numbers: [True, False]"),
        (b'{"scores": ["1", "2"]}', "not finite numbers"),
        (b'{"scores": [NaN, 1.0]}', "not finite numbers"),
        (b'{"scores": [1.0]}', "answered 1 scores for 2 images"),
        (b'{"scores": {"a": 1}}', "no 'scores' list"),
        (b'{"result": [1, 2]}', "no 'scores' list"),
        (b'{"scores": [1' + b"0" * 400 + b", 1.0]}", "not finite numbers: [1000"),
        (b"[" * 100_000 + b"]" * 100_000, "the answer nests JSON arrays/objects deeper than 32 levels"),
        (b'{"scores": [' + b"0," * 2_000_000 + b"0]}", "the answer holds more than 1026 JSON values"),
        (b'{"scores": [1.0, 2.0]}\xff', "body that is not JSON"),
    ],
    ids=["list", "not-json", "booleans", "strings", "nan", "count", "mapping", "missing"]
    + ["int-overflowing-float", "deep", "many-values", "not-utf8"],
)
def test_answers_off_schema_are_remote_reward_errors(body, message):
    with _canned(200, body) as url:
        remote = RemoteReward(url=url, timeout_s=5, retries=0)
        with pytest.raises(RemoteRewardError, match=re.escape(message)):
            remote.score(make_images(2, size=8), ["a", "b"], [{}, {}])


def test_health_answers_off_schema_are_remote_reward_errors():
    for body in (b"[]", b'{"status": "ok"}', b'{"status": "down", "reward": "x"}'):
        with _canned(200, body) as url, pytest.raises(RemoteRewardError):
            RemoteReward(url=url, timeout_s=5, retries=0).setup(torch.device("cpu"))


def test_deeply_nested_error_pages_are_quoted():
    """An error answer is parsed for its message: nested past the depth limit it is quoted, not a RecursionError."""
    with _canned(500, b"[" * 100_000 + b"]" * 100_000) as url:
        remote = RemoteReward(url=url, timeout_s=5, retries=0)
        with pytest.raises(RemoteRewardError, match=re.escape(f"{url}/score failed after 1 attempt(s): HTTP 500: [[[")):
            remote.score(make_images(1, size=8), ["a"], [{}])


def test_limits_too_large_for_a_float_are_used_as_integers():
    """/health limits of 400 digits used to overflow the client's batch arithmetic (an OverflowError)."""
    huge = 10**400
    limits = {"max_body_bytes": huge, "max_images": 8, "max_pixels": huge, "max_total_pixels": huge}
    answer = {"status": "ok", "reward": "canned", "limits": limits, "scores": [1.0, 2.0]}
    with _canned(200, json.dumps(answer).encode()) as url:
        remote = RemoteReward(url=url, timeout_s=5, retries=0)
        remote.setup(torch.device("cpu"))
        assert remote.server_limits is not None and remote.server_limits.max_body_bytes == huge
        assert remote.score(make_images(2, size=8), ["a", "b"], [{}, {}]).tolist() == [1.0, 2.0]


def test_non_json_error_pages_are_quoted():
    with _canned(502, b"<html>Bad Gateway from the proxy</html>") as url:
        remote = RemoteReward(url=url, timeout_s=5, retries=1, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match=r"failed after 2 attempt\(s\): HTTP 502: <html>Bad Gateway"):
            remote.score(make_images(1, size=8), ["a"], [{}])


def test_oversize_answer_is_refused(monkeypatch):
    monkeypatch.setattr(remote_module, "MAX_RESPONSE_BYTES", 1000)
    with _canned(200, b'{"scores": [' + b"1.0, " * 1000 + b"1.0]}") as url:
        with pytest.raises(RemoteRewardError, match="answered more than 1000 bytes"):
            RemoteReward(url=url, timeout_s=5, retries=0).score(make_images(1, size=8), ["a"], [{}])


def _trickling_server(stop: threading.Event) -> tuple[socket.socket, threading.Thread]:
    """Accepts connections and sends a valid-looking answer one byte every 0.2 s, forever."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)

    def run() -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n" + b" " * 100000
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                for byte in answer:
                    if stop.is_set():
                        break
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        break
                    time.sleep(0.2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener, thread


def test_deadline_bounds_a_call_against_a_trickling_server():
    """Socket timeouts never trip on a server that sends a byte every 0.2 s; the per-request deadline must."""
    stop = threading.Event()
    listener, thread = _trickling_server(stop)
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        remote = RemoteReward(url=url, timeout_s=1.0, retries=1, backoff_s=0.05)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"no complete answer within timeout_s=1.0s"):
            remote.setup(torch.device("cpu"))
        assert time.monotonic() - start < 20  # 2 attempts x 1 s + back-off; the server trickles forever
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_server_limits_come_back_as_their_message():
    """A server that refuses the request says why, and the client passes that on (and does not retry a 413)."""
    limits = ServerLimits(wire=WireLimits(max_pixels=100))
    for url in _serve(_EchoMeta(), limits=limits):
        remote = RemoteReward(url=url, timeout_s=5, retries=3, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match=r"HTTP 413: images\[0\] is 16x16 = 256 pixels; the server's limit"):
            remote.score(make_images(1, size=16), ["x"], [{}])  # setup not called: limits unknown to the client
        remote.setup(torch.device("cpu"))  # now it knows them and refuses before sending
        with pytest.raises(RemoteRewardError, match="exceed .* limit of 100 per image"):
            remote.score(make_images(1, size=16), ["x"], [{}])


def test_batches_are_split_to_fit_the_server():
    limits = ServerLimits(wire=WireLimits(max_images=3))
    for url in _serve(_EchoMeta(), limits=limits):
        remote = RemoteReward(url=url, timeout_s=10)
        remote.setup(torch.device("cpu"))
        images = make_images(8, size=32)
        meta = [{"bonus": i} for i in range(8)]
        got = remote.score(images, PROMPTS, meta)
        expected = JpegIncompressibility().score(images, PROMPTS, meta) + torch.arange(8).float()
        torch.testing.assert_close(got, expected)


def test_bearer_token_from_the_environment(monkeypatch):
    monkeypatch.delenv("RLPOST_REWARD_TOKEN", raising=False)
    for url in _serve(_EchoMeta(), token="t0ken"):
        remote = RemoteReward(url=url, timeout_s=5, retries=2, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match="HTTP 401.*RLPOST_REWARD_TOKEN is not set"):
            remote.setup(torch.device("cpu"))
        monkeypatch.setenv("RLPOST_REWARD_TOKEN", "wrong")
        with pytest.raises(RemoteRewardError, match="check the token in RLPOST_REWARD_TOKEN"):
            remote.setup(torch.device("cpu"))
        monkeypatch.setenv("RLPOST_REWARD_TOKEN", "t0ken")
        remote.setup(torch.device("cpu"))
        assert remote.score(make_images(2, size=8), ["a", "b"], [{}, {}]).shape == (2,)


@pytest.mark.parametrize(
    "url", ["ftp://x", "http://", "http://user:pw@host", "http://h:99999", "http://h/?q=1", "http://[::1"]
)
def test_bad_urls_are_refused_at_construction(url):
    with pytest.raises(ValueError, match="url"):
        RemoteReward(url=url)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout_s": float("inf")},
        {"timeout_s": float("nan")},
        {"timeout_s": 1e300},
        {"backoff_s": float("nan")},
        {"backoff_s": float("inf")},
        {"retries": -1},
        {"retries": 1.5},
    ],
    ids=lambda kwargs: f"{next(iter(kwargs))}={next(iter(kwargs.values()))}",
)
def test_unusable_numbers_are_refused_at_construction(kwargs):
    """An infinite timeout or back-off used to be accepted, and every call then ended in an OverflowError or a
    ValueError from the socket or time.sleep rather than a RemoteRewardError."""
    with pytest.raises(ValueError, match=rf"{next(iter(kwargs))} must be"):
        RemoteReward(url="http://127.0.0.1:1", **kwargs)


@pytest.mark.parametrize("token", ["line\nbreak", "t\u00f6ken\u20ac", "two words"])
def test_unusable_client_token_is_a_remote_reward_error(monkeypatch, token):
    """A token http.client cannot put in a header used to escape as ValueError / UnicodeEncodeError."""
    monkeypatch.setenv("RLPOST_REWARD_TOKEN", token)
    for url in _serve(_EchoMeta(), token="t0ken"):
        with pytest.raises(RemoteRewardError, match=re.escape(f"bearer token in $RLPOST_REWARD_TOKEN to {url}")):
            RemoteReward(url=url, timeout_s=5, retries=0).setup(torch.device("cpu"))


def test_batches_are_split_to_fit_the_json_value_limit():
    """Metadata counts against the server's max_json_values; the client splits a batch to fit it."""
    limits = ServerLimits(wire=WireLimits(max_json_values=200))
    for url in _serve(_EchoMeta(), limits=limits):
        remote = RemoteReward(url=url, timeout_s=10, retries=0)
        remote.setup(torch.device("cpu"))
        images = make_images(8, size=16)
        meta = [{"bonus": i, "tags": list(range(30))} for i in range(8)]  # ~36 values each: 8 are over 200
        got = remote.score(images, PROMPTS, meta)
        expected = JpegIncompressibility().score(images, PROMPTS, meta) + torch.arange(8).float()
        torch.testing.assert_close(got, expected)
        with pytest.raises(RemoteRewardError, match=r"metadata\[0\] holds more than 184 JSON values"):
            remote.score(images[:1], PROMPTS[:1], [{"tags": list(range(300))}])
