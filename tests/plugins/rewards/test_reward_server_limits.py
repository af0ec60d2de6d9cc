"""Reward server under hostile input: decompression bombs, oversize and malformed requests, JSON with too many values
or nested too deep, stalled and trickling clients, too many connections, missing or wrong tokens. Every failure must
get an HTTP answer with a JSON error that names the limit; nothing may hold a thread forever or blow up memory.

All servers listen on 127.0.0.1 with a free port; every socket has a timeout, so a regression fails instead of
hanging.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from PIL import Image

from rlpost_rewards._wire import WireLimits, encode_images
from rlpost_rewards.jpeg import JpegIncompressibility
from rlpost_rewards.server import ServerLimits, make_server

from .conftest import make_images

SMALL = WireLimits(max_body_bytes=2 * 1024 * 1024, max_images=8, max_pixels=256 * 256, max_total_pixels=4 * 256 * 256)


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def black_png(width: int, height: int, rows: int | None = None) -> bytes:
    """A real all-black RGB PNG (``rows`` of it compressed; all of them by default): tiny on the wire, huge decoded."""
    rows = height if rows is None else rows
    comp = zlib.compressobj(1)
    row = b"\x00" * (1 + 3 * width)
    block = row * 256
    parts = [comp.compress(block) for _ in range(rows // 256)] + [comp.compress(row) for _ in range(rows % 256)]
    parts.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", b"".join(parts)) + _chunk(b"IEND", b"")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@contextmanager
def serving(reward=None, token: str | None = None, limits: ServerLimits | None = None) -> Iterator[tuple[str, int]]:  # noqa: ANN001
    server = make_server(reward or JpegIncompressibility(), "127.0.0.1", 0, token=token, limits=limits)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[:2]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def post(address, body: bytes, headers: dict[str, str] | None = None, path: str = "/score") -> tuple[int, dict]:  # noqa: ANN001
    conn = http.client.HTTPConnection(*address, timeout=20)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def raw_exchange(address, data: bytes, timeout: float = 20.0) -> tuple[int, dict]:  # noqa: ANN001
    """Send raw bytes, read the whole answer (the server closes), parse status and JSON body."""
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    answer = b"".join(chunks)
    assert answer, "the server closed the connection without an HTTP answer"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head, head
    return int(head.split()[1]), json.loads(body)


def score_body(images: list[str], prompts: list[str] | None = None) -> bytes:
    return json.dumps({"images": images, "prompts": prompts or ["x"] * len(images)}).encode()


# ------------------------------------------------------------------------------------------------ pixel limits


def test_decompression_bomb_is_refused_from_its_header():
    """A PNG whose header claims 20000x20000 (400M pixels, 1.2 GB decoded): 413 naming the limit, not a dropped
    connection (Pillow's own guard raised DecompressionBombError, which the server did not answer)."""
    with serving() as address:
        status, body = post(address, score_body([_b64(black_png(20000, 20000, rows=16))]))
    assert status == 413
    assert "20000x20000 = 400000000 pixels" in body["error"] and "limit is 16777216 pixels per image" in body["error"]


def test_image_count_and_total_pixel_limits():
    tiny = encode_images(make_images(9, size=16))
    with serving(limits=ServerLimits(wire=SMALL)) as address:
        status, body = post(address, score_body(tiny))
        assert (status, "9 images in one request; the server's limit is 8") == (413, body["error"])
        big = encode_images(make_images(5, size=256))  # 5 x 65536 pixels > 4 x 65536
        status, body = post(address, score_body(big))
        assert status == 413 and "pixels per request" in body["error"]
        status, body = post(address, score_body(big[:4]))
        assert status == 200 and len(body["scores"]) == 4


def test_oversize_body_gets_its_413_instead_of_a_reset():
    """The server answers before reading a body over its limit; it must keep reading (and discarding) long enough
    that the client, still sending, gets the answer rather than a connection reset."""
    with serving(limits=ServerLimits(wire=SMALL)) as address:
        status, body = post(address, b"x" * (3 * SMALL.max_body_bytes))
    assert status == 413 and f"over the server's limit of {SMALL.max_body_bytes} bytes" in body["error"]


@pytest.mark.parametrize(
    ("headers", "status", "message"),
    [
        ("Content-Length: abc\r\n", 400, "bad Content-Length 'abc'"),
        ("Content-Length: -5\r\n", 400, "bad Content-Length -5"),
        ("", 411, "a Content-Length header is required"),
        ("Transfer-Encoding: chunked\r\n", 411, "chunked request bodies are not supported"),
    ],
    ids=["not-a-number", "negative", "missing", "chunked"],
)
def test_bad_content_length_is_answered(headers, status, message):
    with serving() as address:
        got, body = raw_exchange(address, f"POST /score HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
    assert got == status and message in body["error"]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"not json", "body is not JSON"),
        (b"[1, 2]", "body must be a JSON object"),
        (b'{"images": "abc", "prompts": []}', "images: expected a list, got str"),
        (b'{"images": [], "prompts": [1]}', "prompts: expected a list of strings"),
        (b'{"images": ["!!"], "prompts": ["x"]}', "images[0]: not base64"),
        (b'{"images": ["aGVsbG8="], "prompts": ["x"]}', "images[0]: not a PNG"),
        (b'{"images": [], "prompts": ["x"]}', "0 images, 1 prompts"),
        (b'{"images": [], "prompts": [], "metadata": [1]}', "metadata: expected a list of JSON objects"),
    ],
)
def test_malformed_requests_are_400_naming_the_field(payload, message):
    with serving() as address:
        status, body = post(address, payload)
    assert status == 400 and message in body["error"], body


# ------------------------------------------------------------------------------------------------ JSON limits

MANY_EMPTY_OBJECTS = b'{"images": [' + b",".join([b"{}"] * 1_300_000) + b'], "prompts": []}'  # 3.7 MiB


def test_too_many_json_values_are_refused_before_parsing():
    """4 MB of empty objects used to be parsed into 1.3 million dicts (a 400 about the image count came after
    ~100 MB); the values are now counted first."""
    with serving() as address:
        status, body = post(address, MANY_EMPTY_OBJECTS)
    assert status == 413, body
    assert "more than 65536 JSON values; the server's limit is 65536 (--max-json-values)" in body["error"]


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"images": [], "prompts": [], "metadata": [' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"]}",
    ],
    ids=["100k-deep-array", "41-deep-metadata"],
)
def test_deeply_nested_json_is_a_400_naming_the_limit(payload):
    """It used to be a 500 with json's RecursionError."""
    with serving() as address:
        status, body = post(address, payload)
    assert status == 400, body
    assert "nests JSON arrays/objects deeper than 32 levels; the server's limit is 32" in body["error"]


def test_json_value_limit_counts_metadata():
    images = encode_images(make_images(2, size=16))
    limits = ServerLimits(wire=WireLimits(max_json_values=100))
    with serving(limits=limits) as address:
        fits = {"images": images, "prompts": ["a", "b"], "metadata": [{"tags": list(range(40))}, {}]}
        status, body = post(address, json.dumps(fits).encode())
        assert status == 200 and len(body["scores"]) == 2
        over = {**fits, "metadata": [{"tags": list(range(100))}, {}]}
        status, body = post(address, json.dumps(over).encode())
        assert status == 413 and "the server's limit is 100 (--max-json-values)" in body["error"]


def test_corrupt_and_mixed_size_pngs_are_400():
    truncated = black_png(64, 64)[:-30]
    sizes = encode_images(make_images(1, size=16)) + encode_images(make_images(1, size=24))
    with serving() as address:
        status, body = post(address, score_body([_b64(truncated)]))
        assert status == 400 and "images[0]: corrupt PNG" in body["error"]
        status, body = post(address, score_body(sizes))
        assert status == 400 and "images must share one size" in body["error"]


def test_every_stdlib_error_is_json():
    with serving() as address:
        assert raw_exchange(address, b"PUT /score HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")[0] == 501
        assert raw_exchange(address, b"GARBAGE / HTTP/1.1 extra\r\n\r\n")[0] == 400
        status, body = raw_exchange(address, b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status == 404 and "unknown path '/nope'" in body["error"]


class _NaN(JpegIncompressibility):
    name = "nan"

    def score(self, images, prompts, metadata):  # noqa: ANN001, ANN201
        return torch.full((images.shape[0],), float("nan"))


def test_broken_reward_output_is_a_500_with_its_reason():
    with serving(_NaN()) as address:
        status, body = post(address, score_body(encode_images(make_images(2, size=16))))
    assert status == 500 and "scoring failed" in body["error"] and "non-finite" in body["error"]


# ------------------------------------------------------------------------------------------------ time limits


def test_stalled_body_is_cut_with_408():
    """Headers promise 100 bytes, one arrives: the thread is freed after timeout_s with a 408, not held forever."""
    with serving(limits=ServerLimits(timeout_s=1.0)) as address:
        start = time.monotonic()
        status, body = raw_exchange(address, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert status == 408 and "not received within 1.0s (1 of 100 bytes)" in body["error"]
    assert time.monotonic() - start < 10


def test_trickling_body_is_cut_by_the_total_deadline():
    """One byte every 0.2 s never trips a per-read timeout of 1 s; the body deadline still cuts it."""
    with serving(limits=ServerLimits(timeout_s=1.0)) as address:
        start = time.monotonic()
        with socket.create_connection(address, timeout=20) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
            answer = b""
            for _ in range(100):  # at most 20 s
                try:
                    sock.sendall(b" ")
                except OSError:
                    break
                time.sleep(0.2)
                sock.setblocking(False)
                try:
                    answer += sock.recv(65536)
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
                if answer:
                    break
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - start < 10


# ------------------------------------------------------------------------------------------------ concurrency


def test_connections_beyond_the_limit_get_503():
    with serving(limits=ServerLimits(timeout_s=5.0, max_connections=2)) as address:
        # The server accepts in arrival order (one listening socket, FIFO accept queue) and takes a connection's slot
        # before it accepts the next, so the third connection finds both slots taken: no waiting needed.
        idle = [socket.create_connection(address, timeout=10) for _ in range(2)]
        try:
            status, body = raw_exchange(address, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status == 503 and "2 connections open" in body["error"]
        finally:
            for sock in idle:
                sock.close()
        # Slots come back once the handler threads see the closed connections: wait for that (on a loaded machine it
        # can take a while), not for a fixed time.
        deadline = time.monotonic() + 30
        while True:
            status, body = raw_exchange(address, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200, body  # slots come back when connections close


class _Blocking(JpegIncompressibility):
    name = "blocking"

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def score(self, images, prompts, metadata):  # noqa: ANN001, ANN201
        self.entered.set()
        assert self.release.wait(20)
        return super().score(images, prompts, metadata)


def test_requests_beyond_max_concurrent_wait_then_get_503():
    reward = _Blocking()
    body = score_body(encode_images(make_images(1, size=16)))
    with serving(reward, limits=ServerLimits(timeout_s=0.5, max_concurrent=1)) as address:
        first: list = []
        thread = threading.Thread(target=lambda: first.append(post(address, body)))
        thread.start()
        try:
            assert reward.entered.wait(10)
            status, answer = post(address, body)
            assert status == 503 and "1 requests in progress" in answer["error"]
        finally:
            reward.release.set()
            thread.join(20)
    assert first[0][0] == 200


# ------------------------------------------------------------------------------------------------ auth


def test_bearer_token():
    body = score_body(encode_images(make_images(1, size=16)))
    with serving(token="s3cret") as address:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            status, answer = post(address, body, headers)
            assert status == 401 and "bearer token" in answer["error"]
        conn = http.client.HTTPConnection(*address, timeout=10)
        conn.request("GET", "/health")
        response = conn.getresponse()
        assert response.status == 401 and response.getheader("WWW-Authenticate", "").startswith("Bearer")
        conn.close()
        status, answer = post(address, body, {"Authorization": "Bearer s3cret"})
        assert status == 200 and len(answer["scores"]) == 1


def test_empty_token_is_refused():
    with pytest.raises(ValueError, match="the bearer token is empty"):
        make_server(JpegIncompressibility(), "127.0.0.1", 0, token="")


# ------------------------------------------------------------------------------------------------ memory (real process)


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@contextmanager
def server_process(*args: str) -> Iterator[tuple[subprocess.Popen, tuple[str, int]]]:
    """``python -m rlpost_rewards.server`` (JPEG, CPU, no token, a free port on 127.0.0.1) as a real process."""
    env = {key: value for key, value in os.environ.items() if key != "RLPOST_REWARD_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    command = [sys.executable, "-m", "rlpost_rewards.server", "--reward", "jpeg-compressibility", "--device", "cpu"]
    proc = subprocess.Popen(
        [*command, "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "serving reward" in line, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        yield proc, ("127.0.0.1", port)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


needs_proc = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc to read peak memory")


@needs_proc
def test_server_process_memory_stays_bounded_under_zero_pngs():
    """The attack on a real server process: 4 all-black 12000x12000 PNGs (a ~10 MB request) took it from
    0.7 to 4 GB. Now: 413 from the headers, and the peak memory does not move."""
    with server_process() as (proc, address):
        ok_images = encode_images(make_images(2, size=32))
        assert post(address, score_body(ok_images))[0] == 200
        before = _peak_rss_mb(proc.pid)
        zeros = _b64(black_png(12000, 12000))
        status, body = post(address, score_body([zeros] * 4))
        assert status == 413 and "12000x12000" in body["error"]
        after = _peak_rss_mb(proc.pid)
        assert after - before < 100, f"peak RSS {before:.0f} -> {after:.0f} MB"


@needs_proc
def test_server_process_memory_stays_bounded_under_many_json_values():
    """3.7 MiB of 1.3 million empty JSON objects grew a real server process by 98 MB; the bound documented in
    docs/rewards.md for the JSON of one request is 3 x body + 100 B x max_json_values (17 MB here)."""
    bound_mb = (3 * len(MANY_EMPTY_OBJECTS) + 100 * 65536) / 2**20  # 65536: the default --max-json-values
    with server_process() as (proc, address):
        assert post(address, score_body(encode_images(make_images(2, size=32))))[0] == 200
        before = _peak_rss_mb(proc.pid)
        status, body = post(address, MANY_EMPTY_OBJECTS)
        after = _peak_rss_mb(proc.pid)
    assert after - before < bound_mb, f"peak RSS {before:.0f} -> {after:.0f} MB, bound {bound_mb:.1f} MB"
    assert status == 413, body


def test_png_helper_makes_valid_pngs():
    with Image.open(io.BytesIO(black_png(40, 30))) as img:
        assert img.size == (40, 30) and img.convert("RGB").getextrema() == ((0, 0), (0, 0), (0, 0))
