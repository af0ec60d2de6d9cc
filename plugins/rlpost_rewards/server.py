"""Serve any local :class:`~rlpost.api.RewardSource` over HTTP for :class:`~rlpost_rewards.remote.RemoteReward`.

Example::

    python -m rlpost_rewards.server --reward jpeg-compressibility --host 127.0.0.1 --port 8765
    python -m rlpost_rewards.server --reward hps-v2.1 --init '{"checkpoint": "/models/HPS_v2.1_compressed.pt"}' \\
        --device cuda --host 0.0.0.0 --port 8765
    python -m rlpost_rewards.server --reward-class my_pkg.rewards:MyReward --port 8765

Endpoints: ``GET /health`` and ``POST /score`` (JSON + base64 PNG, :mod:`rlpost_rewards._wire`; never pickle).
Uses the standard library ``ThreadingHTTPServer``; requests are scored one at a time (a lock around ``score``)
because reward models are not assumed thread safe. There is no authentication: bind to loopback or a private
network only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from rlpost.api import RewardSource

from ._wire import decode_images

__all__ = ["builtin_rewards", "make_server", "main"]

MAX_BODY_BYTES = 512 * 1024 * 1024


def builtin_rewards() -> dict[str, type[RewardSource]]:
    """Name -> class of the rewards this plugin registers (collected through its own hook implementation)."""
    from . import rlpost_register_reward_sources

    found: list[type[RewardSource]] = []
    rlpost_register_reward_sources(found.append)
    return {cls.name: cls for cls in found}


def make_server(reward: RewardSource, host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
    """Build (but do not start) an HTTP server scoring with ``reward``, which must already be set up.

    Args:
        reward: A set-up reward source.
        host: Interface to bind (``127.0.0.1`` by default; the server has no authentication).
        port: TCP port (0 picks a free one; read it back from ``server.server_address``).

    Returns:
        The server; call ``serve_forever()`` (e.g. in a thread) and ``shutdown()``/``server_close()`` to stop.
    """
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            """Silence per-request logging."""

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            if self.path == "/health":
                self._send(200, {"status": "ok", "reward": reward.name})
            else:
                self._send(404, {"error": f"unknown path {self.path}"})

        def do_POST(self) -> None:  # noqa: N802 - stdlib naming
            if self.path != "/score":
                self._send(404, {"error": f"unknown path {self.path}"})
                return
            length = int(self.headers.get("Content-Length", "0"))
            if length <= 0 or length > MAX_BODY_BYTES:
                self._send(413 if length > 0 else 400, {"error": f"bad Content-Length {length}"})
                return
            try:
                request = json.loads(self.rfile.read(length).decode("utf-8"))
                images = decode_images(list(request["images"]))
                prompts = [str(p) for p in request["prompts"]]
                metadata = request.get("metadata") or [{} for _ in prompts]
                if len(prompts) != images.shape[0] or len(metadata) != len(prompts):
                    raise ValueError(f"{images.shape[0]} images, {len(prompts)} prompts, {len(metadata)} metadata")
            except (KeyError, TypeError, ValueError, OSError) as err:
                self._send(400, {"error": f"bad request: {type(err).__name__}: {err}"})
                return
            try:
                with lock:
                    scores = reward.score(images, prompts, metadata)
                self._send(200, {"scores": [float(s) for s in scores.float().cpu().tolist()], "reward": reward.name})
            except Exception as err:  # noqa: BLE001 - report any scoring failure to the client as a 500
                self._send(500, {"error": f"{type(err).__name__}: {err}"})

    return ThreadingHTTPServer((host, port), Handler)


def _load_class(spec: str) -> type[RewardSource]:
    module_name, _, attr = spec.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, RewardSource)):
        raise TypeError(f"{spec} is not a RewardSource subclass")
    return cls


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: build the reward, call ``setup`` once, serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--reward", help=f"built-in reward name: {', '.join(sorted(builtin_rewards()))}")
    which.add_argument("--reward-class", help="any RewardSource as 'module:Class'")
    parser.add_argument("--init", default="{}", help="JSON object of constructor arguments")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    if args.reward:
        table = builtin_rewards()
        if args.reward not in table:
            parser.error(f"unknown reward {args.reward!r}; built-ins: {sorted(table)}")
        cls = table[args.reward]
    else:
        cls = _load_class(args.reward_class)
    reward = cls(**json.loads(args.init))
    reward.setup(torch.device(args.device))
    server = make_server(reward, args.host, args.port)
    host, port = server.server_address[:2]
    host = host.decode() if isinstance(host, bytes) else host  # AF_INET gives str; the stub also allows bytes
    print(f"serving reward {reward.name!r} on http://{host}:{port} (GET /health, POST /score)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
