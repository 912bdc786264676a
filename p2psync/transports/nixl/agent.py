"""What a NIXL agent needs around it: the NIXL module loaded, the UCX environment set while
the agent is created, and the memory type and region of each tensor it registers."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ...core.errors import TransferError

if TYPE_CHECKING:
    import torch

#: The Python module of the pinned wheel (`nixl-cu12`); the `nixl` meta package
#: only re-exports it.
NIXL_MODULE = "nixl_cu12"

MEMORY_TYPES = ("DRAM", "VRAM")

#: NIXL's log levels as Python's.
PY_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}


def load_nixl() -> Any:
    import importlib

    return importlib.import_module(NIXL_MODULE)


@contextmanager
def ucx_environment(overrides: Mapping[str, str]) -> Iterator[None]:
    """Set UCX variables only while the agent and its backend are created: UCX reads
    them then (its global options when libucs loads, the rest at context creation),
    and the rest of the process keeps its own environment."""
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def memory_of(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor's storage."""
    if tensor.device.type == "cpu":
        return "DRAM", 0
    if tensor.device.type == "cuda":
        index = tensor.device.index
        if index is None:
            import torch

            index = torch.cuda.current_device()
        return "VRAM", int(index)
    raise TransferError(f"NIXL cannot register memory of a tensor on device {tensor.device}")


def region_of(tensor: torch.Tensor) -> tuple[int, int]:
    if not tensor.is_contiguous():
        raise TransferError("NIXL registers contiguous tensors only")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()
