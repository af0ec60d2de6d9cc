"""How tests compare float results that come from different code paths (policy: ``tests/meta/test_bitwise_policy.py``).

Bitwise equality is asserted only where the project documents it (``docs/design.md``, "Determinism"). Everywhere
else two float results that *should* agree were computed by different kernels: a model and its deep copy (the
loaded weights sit at other memory alignments, so the CPU's matrix-multiply library may pick other code paths), a
batch of 1 and a batch of 2, our sampler and diffusers'. On another CPU type those differ in the last bits.

``FP32_RTOL`` / ``FP32_ATOL`` bound that for fp32 forwards of O(1) outputs. Measured: the tiny SD3 velocity of a
model and of its deep copy differ by 2.4e-7 (1.5e-7 relative) on an AMD EPYC, ~1 ulp; the bound leaves ~50x room.
The defects these comparisons look for are orders of magnitude larger: a reference model that aliases the trained
weights moves the tiny SD3 velocity by 0.38 (``test_full_finetune_reference_copy``), a LoRA adapter left on by 1.2
(``test_lora_reference_disables_adapter``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FP32_ATOL", "FP32_RTOL", "PIXEL_ATOL", "assert_fp32_close", "assert_pixels_close"]

FP32_RTOL = 1e-5
FP32_ATOL = 1e-6

PIXEL_ATOL = 1
"""uint8 images rendered from fp32 samples: a last-bit difference can flip one ``round(255·x)`` by 1 level."""


def assert_fp32_close(actual: Any, expected: Any, *, rtol: float = FP32_RTOL, atol: float = FP32_ATOL) -> None:
    """``torch.testing.assert_close`` with the fp32 cross-code-path tolerance (dtype and shape must match)."""
    torch.testing.assert_close(torch.as_tensor(actual), torch.as_tensor(expected), rtol=rtol, atol=atol)


def assert_pixels_close(actual: Any, expected: Any, atol: int = PIXEL_ATOL) -> None:
    """Two uint8 images (arrays or tensors) of the same shape differ by at most ``atol`` levels per channel."""
    a, b = torch.as_tensor(actual).int(), torch.as_tensor(expected).int()
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = int((a - b).abs().max()) if a.numel() else 0
    assert diff <= atol, f"images differ by {diff} levels (allowed {atol})"
