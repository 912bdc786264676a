"""Digests of written bytes: computed over the same regions by sender and engine."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor (copied to host memory first if on a device)."""
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().data


def digest(data: memoryview, spans: Iterable[tuple[int, int]]) -> str:
    """blake2b-128 of the concatenated `(offset, nbytes)` spans of `data`."""
    h = hashlib.blake2b(digest_size=16)
    for offset, nbytes in spans:
        h.update(data[offset : offset + nbytes])
    return h.hexdigest()
