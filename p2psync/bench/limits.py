"""The machine's limits, measured in the same run: memcpy, raw transport writes and a raw
gloo broadcast, with the load average (other users of a shared machine) at the time."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: Transports whose both sides can run in one process (the raw measurement's loopback).
LOOPBACK_TRANSPORTS = ("mooncake", "nixl", "samehost")


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


def transport_loopback(name: str, nbytes: int, chunk_bytes: int = 16 << 20, repeats: int = 3) -> dict[str, Any]:
    """One batched write of `nbytes` in `chunk_bytes` pieces from one instance of the registered
    transport `name` to another in this process, through the Transport and Peer interfaces
    that p2psync's sessions use (as an engine would expose its memory and a trainer write)."""
    import torch

    from ..core.plugins import registry
    from ..core.transport import WriteBatch
    from ..core.types import TargetParam, TargetTable

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    receiver, sender = registry().make_transport(name), registry().make_transport(name)
    peer = None
    try:
        info = receiver.expose([dst])
        table = TargetTable(
            engine_id="raw", rank=0, world_size=1, engine="none", layout_key={}, transport=name,
            transport_info=info, control_url="",
            params=(TargetParam("raw", (nbytes,), "uint8", dst.data_ptr(), nbytes),),
        )
        sender.register_buffer(src)
        peer = sender.open(table)
        batch = WriteBatch()
        for offset in range(0, nbytes, chunk_bytes):
            batch.add(src.data_ptr() + offset, dst.data_ptr() + offset, min(chunk_bytes, nbytes - offset))
        seconds = _timed(lambda: peer.write(batch, timeout=600), repeats)
        if not torch.equal(src, dst):
            raise RuntimeError(f"{name} loopback write did not deliver the bytes")
        described = sender.describe()
        return _rate(nbytes, seconds, transport=name, protocol=described.get("protocol", "-"), chunk_bytes=chunk_bytes)
    finally:
        if peer is not None:
            peer.close()
        sender.close()
        receiver.close()


def gloo_loopback(nbytes: int, repeats: int = 3) -> dict[str, Any]:
    """A gloo broadcast of `nbytes` from one member of a two-member group to the other, both in
    this process (one thread each): the wire the broadcast path uses, alone."""
    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    groups: list[Any] = [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))

    joiner = threading.Thread(target=join, args=(1,))
    joiner.start()
    join(0)
    joiner.join()
    tensors = [torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)]
    opts = dist.BroadcastOptions()
    opts.rootRank = 0

    def once() -> None:
        works = [group.broadcast([tensor], opts) for group, tensor in zip(groups, tensors)]
        for work in works:
            work.wait()

    seconds = _timed(once, repeats)
    if not torch.equal(*tensors):
        raise RuntimeError("gloo loopback broadcast did not deliver the bytes")
    return _rate(nbytes, seconds, transport="gloo", protocol="tcp")


def measure(nbytes: int, transport: str) -> dict[str, Any]:
    """The load averages (1, 5, 15 minutes), memcpy, the raw transport where it can loop back
    in one process (else None) and the raw gloo broadcast."""
    return {
        "load_average": list(os.getloadavg()),
        "memcpy": memcpy(nbytes),
        "raw_transport": transport_loopback(transport, nbytes) if transport in LOOPBACK_TRANSPORTS else None,
        "raw_gloo": gloo_loopback(nbytes),
    }


def measure_apart(nbytes: int, transport: str) -> dict[str, Any]:
    """`measure` in a fresh process, so that no transport threads outlive it here."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(measure, nbytes, transport).result()
