"""Start options of ``python -m rlpost_rewards.server``: every bad one is a one-line usage error with exit status 2
naming the option, never a traceback and never a server that starts but cannot answer; a bearer-token variable that
is set but unusable refuses to start (fail closed) instead of serving without authentication.

``main`` runs in a thread so that a regression that starts serving fails the test (the thread is still alive after a
generous bound) instead of hanging it; every port is a free one on 127.0.0.1.
"""

from __future__ import annotations

import socket
import threading

import pytest

from rlpost_rewards.jpeg import JpegCompressibility
from rlpost_rewards.server import main, make_server

JPEG = ["--reward", "jpeg-compressibility", "--device", "cpu", "--host", "127.0.0.1"]


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    """Run ``main(argv)`` to its end (at most 30 s); return what ended it (an exit status or an exception) and
    stderr. A server that started serving instead fails here."""
    outcome: list[object] = []

    def target() -> None:
        try:
            main(argv)
            outcome.append("returned")
        except SystemExit as exc:
            outcome.append(exc.code)
        except BaseException as exc:  # noqa: BLE001 - the test reports what escaped
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"the server started with {argv} instead of refusing: {capsys.readouterr()}"
    return outcome[0], capsys.readouterr().err


def assert_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    outcome, err = run_main(argv, capsys)
    assert outcome == 2, (outcome, err)
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("python -m rlpost_rewards.server: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


BAD_OPTIONS = [
    (["--max-body-mb", "inf"], ["--max-body-mb", "finite number above 0", "'inf'"]),
    (["--max-body-mb", "nan"], ["--max-body-mb", "'nan'"]),
    (["--max-body-mb", "0"], ["--max-body-mb", "'0'"]),
    (["--max-body-mb", "1e-12"], ["max_body_bytes must be a positive integer"]),
    (["--timeout", "inf"], ["--timeout", "at most 86400", "'inf'"]),
    (["--timeout", "-1"], ["--timeout", "'-1'"]),
    (["--timeout", "1e300"], ["--timeout", "'1e300'"]),
    (["--port", "70000"], ["--port", "1-65535", "'70000'"]),
    (["--port", "-1"], ["--port", "'-1'"]),
    (["--port", "http"], ["--port", "'http'"]),
    (["--max-images", "0"], ["--max-images", "whole number >= 1"]),
    (["--max-json-values", "-5"], ["--max-json-values", "'-5'"]),
    (["--max-concurrent", "0"], ["--max-concurrent"]),
    (["--init", '{"bogus": 1}'], ["--init", "JpegCompressibility takes no argument(s) 'bogus'", "takes: quality"]),
    (["--init", "[1, 2]"], ["--init", "expected a JSON object", "got list"]),
    (["--init", "{not json"], ["--init: not JSON"]),
    (["--init", "[" * 50_000 + "]" * 50_000], ["--init: not JSON", "deeper than 32 levels"]),
    (["--init", '{"quality": 500}'], ["--init", "quality must be in [1, 100], got 500"]),
    (["--device", "bogus"], ["--device 'bogus'"]),
]


@pytest.mark.parametrize(("args", "fragments"), BAD_OPTIONS, ids=[" ".join(args)[:40] for args, _ in BAD_OPTIONS])
def test_bad_options_are_one_line_usage_errors(args, fragments, capsys):
    assert_usage_error([*JPEG, "--port", "0", *args], capsys, *fragments)


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ("rlpost_rewards.jpeg.JpegCompressibility", ["expected 'module:Class'"]),
        (":JpegCompressibility", ["expected 'module:Class'"]),
        ("no_such_module_for_rlpost_tests:Reward", ["cannot import module 'no_such_module_for_rlpost_tests'"]),
        ("rlpost_rewards.jpeg:Nope", ["module 'rlpost_rewards.jpeg' has no attribute 'Nope'"]),
        ("rlpost_rewards.jpeg:jpeg_size_kb", ["is not a RewardSource subclass (got function)"]),
        ("rlpost:RewardSource", ["is abstract: it does not implement score"]),
    ],
    ids=["no-colon", "no-module", "missing-module", "missing-class", "not-a-class", "abstract"],
)
def test_bad_reward_class_is_a_usage_error(spec, fragments, capsys):
    assert_usage_error(["--reward-class", spec, "--device", "cpu", "--port", "0"], capsys, "--reward-class", *fragments)


def test_unknown_reward_and_missing_checkpoint_are_usage_errors(capsys, tmp_path):
    assert_usage_error([*JPEG[2:], "--reward", "nope", "--port", "0"], capsys, "unknown reward 'nope'", "hps-v2.1")
    missing = tmp_path / "HPS_v2.1_compressed.pt"
    init = f'{{"checkpoint": "{missing}"}}'
    args = ["--reward", "hps-v2.1", "--init", init, "--device", "cpu", "--port", "0"]
    assert_usage_error(args, capsys, "setting up reward 'hps-v2.1' failed: CheckpointNotFoundError", str(missing))


def test_port_in_use_is_named(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert_usage_error([*JPEG, "--port", str(port)], capsys, f"127.0.0.1:{port} is already in use", "--port")


@pytest.mark.parametrize("token", ["", "   ", "two words", "t\u00f6ken", "line\nbreak"])
def test_unusable_token_refuses_to_start(token, capsys, monkeypatch):
    """An empty token used to mean "no authentication": the server answered /health without one. Now it fails closed,
    naming the variable (never its value)."""
    monkeypatch.setenv("RLPOST_TEST_TOKEN", token)
    err = assert_usage_error(
        [*JPEG, "--port", "0", "--token-env", "RLPOST_TEST_TOKEN"], capsys, "bearer token in $RLPOST_TEST_TOKEN"
    )
    assert "refusing to start" in err and "unset it to serve without a token" in err
    if token.strip():
        assert token not in err


@pytest.mark.parametrize("token", ["", " s3cret", "s3cret\n", "t\u00f6ken"])
def test_make_server_refuses_an_unusable_token(token):
    with pytest.raises(ValueError, match="the bearer token"):
        make_server(JpegCompressibility(), "127.0.0.1", 0, token=token)
