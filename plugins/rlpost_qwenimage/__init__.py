"""Qwen-Image (``Qwen/Qwen-Image``, diffusers ``QwenImagePipeline``) as an rlpost model family, written as a plugin.

The adapter (:class:`rlpost_qwenimage.policy.QwenImagePolicy`, recipe name ``qwen-image``) and its tiny random
build (:mod:`rlpost_qwenimage.tiny`) import nothing of rlpost but the facade (``from rlpost import ...``): adding a
model family needs no change to rlpost (``docs/models.md``, "Adding a model family"; ``README.md`` in this folder).

Registering costs nothing: the hook imports the adapter lazily, and weights load in ``setup()``.
"""

from __future__ import annotations

from rlpost import Policy, Registry, hookimpl

__all__ = ["rlpost_register_models"]


@hookimpl
def rlpost_register_models(register: Registry[Policy]) -> None:
    """Register :class:`~rlpost_qwenimage.policy.QwenImagePolicy` (short name ``qwen-image``)."""
    from rlpost_qwenimage.policy import QwenImagePolicy

    register(QwenImagePolicy)
