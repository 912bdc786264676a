"""Device selection: CUDA where it works, CPU otherwise, and a clear error when
CUDA is asked for without it."""

from __future__ import annotations

import pytest
import torch

from p2psync.core.devices import resolve, why_no_cuda
from p2psync.core.errors import P2PSyncError


def test_auto_picks_what_this_machine_has():
    placement = resolve("auto")
    if torch.cuda.is_available():
        assert (placement.device, placement.collective_backend, placement.pin_buffers) == ("cuda", "nccl", True)
    else:
        assert (placement.device, placement.collective_backend, placement.pin_buffers) == ("cpu", "gloo", False)


def test_cpu_is_always_gloo_and_plain_buffers():
    assert resolve("cpu") == resolve("cpu")
    assert (resolve("cpu").collective_backend, resolve("cpu").pin_buffers) == ("gloo", False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot happen here")
def test_cuda_without_cuda_is_refused_with_the_reason():
    with pytest.raises(P2PSyncError, match=r"device cuda requested, but CUDA is not available \(torch .*\)"):
        resolve("cuda")
    assert "torch.cuda.is_available() is False" in why_no_cuda()


def test_unknown_device_is_refused():
    with pytest.raises(P2PSyncError, match="device must be one of auto, cpu, cuda; got 'tpu'"):
        resolve("tpu")
