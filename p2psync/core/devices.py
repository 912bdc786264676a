"""Where a run's tensors live: CPU here, CUDA on GPU machines, chosen in one place.

On CUDA, trainer collectives run on NCCL and transfer buffers are pinned host
memory (every transport can read it, and copies from the GPU into it run at full
PCIe speed); on CPU, gloo and plain host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import P2PSyncError

DEVICES = ("cpu", "cuda")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def why_no_cuda() -> str:
    """The reason CUDA cannot be used here, in words, or "" if it can."""
    import torch

    if torch.cuda.is_available():
        return ""
    build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU build")
    return f"CUDA is not available ({build}, torch.cuda.is_available() is False)"


@dataclass(frozen=True)
class Placement:
    """What one device kind means for a run."""

    device: str
    collective_backend: str
    pin_buffers: bool


def resolve(device: str = "auto") -> Placement:
    """`auto` picks CUDA where it works, else CPU; asking for CUDA without it is an error."""
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device not in DEVICES:
        raise P2PSyncError(f"device must be one of auto, {', '.join(DEVICES)}; got {device!r}")
    if device == "cuda" and (reason := why_no_cuda()):
        raise P2PSyncError(f"device cuda requested, but {reason}")
    return Placement(device, "nccl" if device == "cuda" else "gloo", device == "cuda")
