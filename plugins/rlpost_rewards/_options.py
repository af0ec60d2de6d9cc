"""Start options of the reward server (:mod:`rlpost_rewards.server`), checked before anything is loaded or bound.

Every bad option is a one-line usage error with exit status 2 naming the option, the value and what is allowed
(the CLI's rule for bad input, ``docs/robustness.md``): numbers must be finite and in range, the bearer token must be
usable when its variable is set (an empty one would otherwise mean "no authentication": the server fails closed), the
reward class must be a ``module:Class`` :class:`~rlpost.RewardSource`, and ``--init`` must be a JSON object of
arguments its constructor takes.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import ipaddress
import math
import os
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from rlpost import RewardSource

from ._http import MAX_TIMEOUT_S, ServerLimits
from ._jsonscan import loads_bounded

__all__ = [
    "OneLineParser",
    "build_reward",
    "is_loopback",
    "load_reward_class",
    "parse_device",
    "port",
    "positive_float",
    "positive_int",
    "server_parser",
    "token_from_env",
    "token_problem",
]


class OneLineParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line (``prog: error: ...``) and exit status 2, without the usage."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line and exit 2."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def positive_float(limit: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number in ``(0, limit]``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0 < value <= limit):
            bound = "" if math.isinf(limit) else f" and at most {limit:g}"
            raise argparse.ArgumentTypeError(f"expected a finite number above 0{bound}, got {text!r}")
        return value

    return parse


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def port(text: str) -> int:
    """An argparse type: a TCP port, 1-65535, or 0 for a free one chosen by the system."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1-65535 (or 0 for a free one), got {text!r}")
    return value


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a bearer token, or ``None``.

    It must be non-empty printable ASCII without spaces: the client sends it in an HTTP header (latin-1, no line
    breaks) and the server strips the header value, so anything else could never match and would lock every client
    out, or worse, an empty token would read as "no authentication".
    """
    if not token:
        return "is empty"
    if not all("!" <= char <= "~" for char in token):
        return "holds characters other than printable ASCII without spaces"
    return None


def token_from_env(name: str) -> str | None:
    """The bearer token in environment variable ``name``; ``None`` when the variable is not set.

    Raises:
        ValueError: The variable is set but cannot be a token (empty, spaces, non-ASCII): serving without
            authentication then would fail open.
    """
    if not name:
        return None
    token = os.environ.get(name)
    if token is None:
        return None
    problem = token_problem(token)
    if problem is not None:
        raise ValueError(
            f"the bearer token in ${name} {problem}; refusing to start without the authentication it asks for "
            f"(set ${name} to a secret such as `openssl rand -hex 32`, or unset it to serve without a token)"
        )
    return token


def load_reward_class(spec: str) -> type[RewardSource]:
    """The class named by ``--reward-class`` (``module:Class``).

    Raises:
        ValueError: Not ``module:Class``, not importable, no such attribute, not a ``RewardSource`` subclass, or
            an abstract one.
    """
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(f"--reward-class: expected 'module:Class' (e.g. my_pkg.rewards:MyReward), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--reward-class {spec!r}: cannot import module {module_name!r} ({err})") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--reward-class {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, RewardSource)):
        raise ValueError(f"--reward-class {spec!r} is not a RewardSource subclass (got {type(obj).__name__})")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise ValueError(f"--reward-class {spec!r} is abstract: it does not implement {missing}")
    return obj


def build_reward(cls: type[RewardSource], init_text: str) -> RewardSource:
    """``cls(**init)`` for the JSON object ``--init``, whose keys the constructor must take.

    Raises:
        ValueError: ``--init`` is not a JSON object, names arguments the constructor does not take or misses one it
            needs, or the constructor refuses the values (its ``TypeError``/``ValueError``).
    """
    try:
        init = loads_bounded(init_text.encode("utf-8", "surrogatepass"), 10_000, 32, "--init")
    except ValueError as err:
        raise ValueError(f"--init: not JSON ({err}): expected a JSON object of constructor arguments") from None
    if not isinstance(init, dict):
        raise ValueError(f"--init: expected a JSON object of constructor arguments, got {type(init).__name__}")
    signature = inspect.signature(cls)
    params = signature.parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = sorted(set(init) - set(named))
        if unknown:
            raise ValueError(
                f"--init: {cls.__name__} takes no argument(s) {', '.join(map(repr, unknown))}; "
                f"it takes: {', '.join(named) or 'none'}"
            )
    try:
        signature.bind(**init)
        return cls(**init)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--init: {cls.__name__}(**{init_text.strip()[:200]}) failed: {err}") from None


def parse_device(text: str) -> torch.device:
    """The ``--device`` as a torch device that exists here.

    Raises:
        ValueError: Not a device string torch knows, or a CUDA device this machine does not have.
    """
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"--device {text!r}: {' '.join(str(err).split())}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise ValueError(f"--device {text!r}: this machine has {count} CUDA device(s); use --device cpu")
    return device


def server_parser(description: str, builtins: list[str], defaults: ServerLimits, token_env: str) -> OneLineParser:
    """The server's argument parser: every number is range-checked by its type, so a bad one is a usage error."""
    wire = defaults.wire
    parser = OneLineParser(
        prog="python -m rlpost_rewards.server",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--reward", help=f"built-in reward name: {', '.join(builtins)}")
    which.add_argument("--reward-class", help="any RewardSource as 'module:Class'")
    parser.add_argument("--init", default="{}", help="JSON object of constructor arguments")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8765, help="TCP port, 1-65535 (0: a free one, printed)")
    parser.add_argument("--token-env", default=token_env, help="environment variable holding the bearer token")
    parser.add_argument("--max-body-mb", type=positive_float(), default=wire.max_body_bytes / 2**20)
    parser.add_argument("--max-images", type=positive_int, default=wire.max_images, help="images per request")
    parser.add_argument("--max-pixels", type=positive_int, default=wire.max_pixels, help="pixels per image")
    parser.add_argument(
        "--max-total-pixels", type=positive_int, default=wire.max_total_pixels, help="pixels per request"
    )
    parser.add_argument(
        "--max-json-values", type=positive_int, default=wire.max_json_values, help="JSON values per request body"
    )
    parser.add_argument(
        "--timeout",
        type=positive_float(MAX_TIMEOUT_S),
        default=defaults.timeout_s,
        help="socket and body timeout (s)",
    )
    parser.add_argument("--max-connections", type=positive_int, default=defaults.max_connections)
    parser.add_argument("--max-concurrent", type=positive_int, default=defaults.max_concurrent)
    return parser


def is_loopback(host: str) -> bool:
    """Whether ``host`` names the loopback interface (only this machine can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
