"""CUDA IPC: the engine exports its parameter memory once, the trainer maps it and copies.

UNTESTED: this project's machines have no GPU, so nothing here has run. It
follows torch.multiprocessing's own CUDA sharing (`_share_cuda_` /
`_new_shared_cuda`, see torch/multiprocessing/reductions.py): a handle names a
whole caching-allocator segment (one cudaMalloc), so the engine exports one
handle per segment, with the byte range its parameters occupy, and thousands of
parameters cost a few handles. The trainer opens each handle once (CUDA maps it
once per process) and addresses the mapping by the engine's own addresses. A
trainer in the engine's own process (a hybrid engine) cannot open its own
handles and needs none: it uses the addresses as they are.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...core.errors import TransferError, TransferTimeout
from ...core.transport import Peer, WriteBatch
from ...core.memory import AddressMap, scatter

if TYPE_CHECKING:
    import torch


def _text(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def device_uuid(index: int) -> str:
    """A GPU's identity across processes, whatever CUDA_VISIBLE_DEVICES each one sees."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def export(tensors: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """Engine side: one IPC handle per allocator segment that holds any of `tensors`."""
    segments: dict[int, dict[str, Any]] = {}
    for i, tensor in enumerate(tensors):
        storage = tensor.untyped_storage()
        try:
            device, handle, size, offset, counter, counter_offset, event, event_sync = storage._share_cuda_()
        except RuntimeError as exc:  # memory not from torch's caching allocator cannot be exported this way
            raise ValueError(
                f"tensor {i} of {len(tensors)} on {tensor.device} cannot be shared by CUDA IPC: {exc}"
            ) from exc
        base = storage.data_ptr() - offset
        segment = segments.setdefault(
            base,
            {
                "base": base,
                "device": device_uuid(device),
                "handle": _text(handle),
                "counter": [_text(counter), counter_offset],
                "event": _text(event),
                "event_sync": bool(event_sync),
                "nbytes": 0,
            },
        )
        segment["nbytes"] = max(segment["nbytes"], offset + size)
    return list(segments.values())


def _local_index(uuid: str) -> int:
    import torch

    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise TransferError(f"the engine's GPU {uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")


class _OwnMemory:
    """Device memory of this very process, in the form `torch.as_tensor` takes."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


def _open(seg: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The segment's bytes as a uint8 tensor of this process."""
    import torch

    counter, counter_offset = seg["counter"]
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            _bytes(seg["handle"]),
            seg["nbytes"],
            0,
            _bytes(counter),
            counter_offset,
            _bytes(seg["event"]),
            seg["event_sync"],
        )
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def open_segments(segments: Sequence[dict[str, Any]], *, same_process: bool) -> tuple[AddressMap, torch.device]:
    """Trainer side: map every exported segment, addressed as the engine addresses it;
    also return the device they live on."""
    import torch

    memory, device = AddressMap(), torch.device("cuda")
    for seg in segments:
        device = torch.device("cuda", _local_index(seg["device"]))
        if same_process:
            memory.add(torch.as_tensor(_OwnMemory(seg["base"], seg["nbytes"]), device=device))
        else:
            memory.add(_open(seg, device), seg["base"])
    return memory, device


class CudaIpcPeer(Peer):
    """Copies from the trainer's buffers into one engine rank's mapped memory on a
    stream of its own, polled until done or late. UNTESTED (no GPU here)."""

    def __init__(self, segments: Sequence[dict[str, Any]], local: AddressMap, who: str, *, same_process: bool) -> None:
        import torch

        self.remote, device = open_segments(segments, same_process=same_process)
        self.local = local
        self.who = who
        self.stream = torch.cuda.Stream(device=device)

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        import torch

        deadline = time.monotonic() + timeout
        # The session filled the buffer on the default stream of its thread.
        self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        try:
            with torch.cuda.stream(self.stream):
                for local, remote, length in zip(batch.local, batch.remote, batch.lengths):
                    scatter(self.local.view(local, length), self.remote.pieces(remote, length))
                done = torch.cuda.Event()
                done.record(self.stream)
        except (ValueError, RuntimeError) as exc:
            raise TransferError(f"{self.who}: CUDA IPC copy failed: {exc}") from exc
        pause = 50e-6
        while not done.query():
            if time.monotonic() > deadline:
                # Copies already queued cannot be recalled; they only reach an engine that is now failed.
                raise TransferTimeout(
                    f"{self.who}: CUDA IPC copies of {batch.nbytes} bytes not done after {timeout:.1f} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
