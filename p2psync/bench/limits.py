"""The machine's limits, measured in the same run: memcpy and raw Mooncake writes."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def _timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rate(nbytes: int, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9, **extra}


def memcpy(nbytes: int, repeats: int = 3) -> dict[str, Any]:
    """`torch` copy of `nbytes` between two host tensors, at torch's default thread count."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    return _rate(nbytes, _timed(lambda: dst.copy_(src), repeats), threads=torch.get_num_threads())


def mooncake_loopback(nbytes: int, chunk_bytes: int = 16 << 20, repeats: int = 3) -> dict[str, Any]:
    """One batched write of `nbytes` in `chunk_bytes` pieces between two TransferEngines
    in this process, through the same peer code that p2psync's sessions use."""
    import torch

    from ..core.transport import WriteBatch
    from ..transports.mooncake.transport import MooncakePeer, MooncakeTransport

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    receiver, sender = MooncakeTransport(), MooncakeTransport()
    try:
        session = receiver.expose([dst])["session"]
        sender.register_buffer(src)
        batch = WriteBatch()
        for offset in range(0, nbytes, chunk_bytes):
            batch.add(src.data_ptr() + offset, dst.data_ptr() + offset, min(chunk_bytes, nbytes - offset))
        peer = MooncakePeer(sender.engine, session)
        seconds = _timed(lambda: peer.write(batch, timeout=600), repeats)
        if not torch.equal(src, dst):
            raise RuntimeError("Mooncake loopback write did not deliver the bytes")
        return _rate(nbytes, seconds, transport="mooncake", protocol=sender.protocol, chunk_bytes=chunk_bytes)
    finally:
        sender.close()
        receiver.close()


def measure(nbytes: int, transport: str) -> dict[str, Any]:
    """The 1-minute load average (other users of the machine), memcpy, and the raw
    transport throughput where the transport is Mooncake (else None)."""
    return {
        "load_average": os.getloadavg()[0],
        "memcpy": memcpy(nbytes),
        "raw_transport": mooncake_loopback(nbytes) if transport == "mooncake" else None,
    }


def measure_apart(nbytes: int, transport: str) -> dict[str, Any]:
    """`measure` in a fresh process, so that no transport threads outlive it here."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(measure, nbytes, transport).result()
