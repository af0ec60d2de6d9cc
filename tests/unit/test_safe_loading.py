"""No pickle anywhere: an AST scan of the source tree, and a malicious pickle is rejected by our loading path."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from rlpost.engine.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_tensor_file,
    read_checkpoint,
    write_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]
UNSAFE = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("dill", "load"), ("dill", "loads"),
          ("cloudpickle", "load"), ("cloudpickle", "loads"), ("joblib", "load")}  # fmt: skip


def _dotted(node: ast.AST) -> tuple[str, str] | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


def unsafe_calls(source: str) -> list[tuple[int, str]]:
    """Lines calling pickle-based loaders, or ``torch.load`` without ``weights_only=True``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in {"pickle", "dill", "cloudpickle"}:
            found.extend((node.lineno, f"from {node.module} import {a.name}") for a in node.names if "load" in a.name)
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name in UNSAFE:
            found.append((node.lineno, ".".join(name)))
        if name == ("torch", "load"):
            ok = any(
                kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True
                for kw in node.keywords
            )
            if not ok:
                found.append((node.lineno, "torch.load without weights_only=True"))
    return found


def test_scanner_catches_the_patterns():
    bad = "import pickle, torch\npickle.loads(b)\ntorch.load(p)\ntorch.load(p, weights_only=False)\n"
    assert [line for line, _ in unsafe_calls(bad)] == [2, 3, 4]
    assert unsafe_calls("import torch\ntorch.load(p, map_location='cpu', weights_only=True)\n") == []


def test_source_tree_has_no_unsafe_loading():
    problems = []
    for base in ("rlpost", "plugins"):
        for path in sorted((ROOT / base).rglob("*.py")):
            for line, what in unsafe_calls(path.read_text()):
                problems.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not problems, "unsafe deserialisation:\n" + "\n".join(problems)


class _Exploit:
    def __reduce__(self):  # runs os.system at unpickling time
        import os

        return (os.system, ("touch EXPLOITED",))


def test_malicious_pickle_is_rejected(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    payload = pickle.dumps({"w": _Exploit()})
    (tmp_path / "evil.pt").write_bytes(payload)
    with pytest.raises(CheckpointError, match="not a safe tensor file"):
        load_tensor_file(tmp_path / "evil.pt")
    # A pickle smuggled into a checkpoint in place of the safetensors weights is rejected as well.
    ckpt = write_checkpoint(tmp_path / "run", 1, {"trainable.0000": __import__("torch").ones(1)}, {"step": 1})
    (ckpt / "weights.safetensors").write_bytes(payload)
    with pytest.raises(CheckpointError):
        read_checkpoint(find_checkpoint("latest", tmp_path / "run"))
    (tmp_path / "evil.safetensors").write_bytes(payload)
    with pytest.raises(CheckpointError):
        load_tensor_file(tmp_path / "evil.safetensors")
    assert not (tmp_path / "EXPLOITED").exists()
