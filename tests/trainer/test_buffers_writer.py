"""Transfer buffers and the per-engine write threads, against transports written here.

`MemoryTransport` really moves bytes (ctypes.memmove from registered buffers into
exposed engine memory), so what a write does can be checked bit for bit. The
other peers fail, time out, or hang, the ways real transports do.
"""

from __future__ import annotations

import ctypes
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2psync.trainer.buffers import BufferPool, Lease
from p2psync.core.errors import ControlError, TransferError, TransferTimeout
from p2psync.core.transport import Peer, Transport, WriteBatch
from p2psync.core.types import TargetId, TargetTable
from p2psync.trainer.connection import Connection
from p2psync.trainer.writer import EngineWriter, WriteJob

# -- transports ------------------------------------------------------------------------------


def span(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


class MemoryTransport(Transport):
    """One-sided writes within this process: memmove from registered buffers into exposed memory."""

    name = "memory"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.registered: dict[int, int] = {}
        self.register_calls: list[tuple[int, int]] = []
        self.unregister_calls: list[int] = []
        self.exposed: list[tuple[int, int]] = []

    def expose(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        regions = [span(t) for t in tensors]
        self.exposed.extend(regions)
        return {"regions": [list(r) for r in regions]}

    def register_buffer(self, buffer: torch.Tensor) -> None:
        addr, nbytes = span(buffer)
        self.register_calls.append((addr, nbytes))
        self.registered[addr] = nbytes

    def unregister_buffer(self, buffer: torch.Tensor) -> None:
        self.unregister_calls.append(buffer.data_ptr())
        del self.registered[buffer.data_ptr()]

    def open(self, table: TargetTable) -> Peer:
        return MemoryPeer(self)

    def close(self) -> None:
        self.registered.clear()

    def check_local(self, addr: int, length: int) -> None:
        if not any(a <= addr and addr + length <= a + n for a, n in self.registered.items()):
            raise TransferError(f"local range {addr:#x}+{length} is not in a registered buffer")

    def check_remote(self, addr: int, length: int) -> None:
        if not any(a <= addr and addr + length <= a + n for a, n in self.exposed):
            raise TransferError(f"remote range {addr:#x}+{length} is not exposed")


class MemoryPeer(Peer):
    def __init__(self, transport: MemoryTransport, gate: threading.Event | None = None) -> None:
        self.transport = transport
        self.gate = gate
        self.calls = 0

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        self.calls += 1
        if self.gate is not None and not self.gate.wait(timeout):
            raise TransferTimeout(f"gate not opened within {timeout} s")
        for local, remote, length in zip(batch.local, batch.remote, batch.lengths):
            self.transport.check_local(local, length)
            self.transport.check_remote(remote, length)
            ctypes.memmove(remote, local, length)


class FailingPeer(Peer):
    def __init__(self, exc: Exception | None = None) -> None:
        self.exc = exc or TransferError("connection reset by peer")
        self.calls = 0

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        self.calls += 1
        raise self.exc


class SleepyPeer(Peer):
    """Sleeps past the timeout, then reports the timeout, as a polling transport does."""

    def __init__(self, overrun: float = 0.05) -> None:
        self.overrun = overrun
        self.calls = 0

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        self.calls += 1
        time.sleep(timeout + self.overrun)
        raise TransferTimeout(f"batch of {batch.nbytes} bytes not landed after {timeout} s")


class HeldPeer(Peer):
    """Inside `write` until the test lets it go (`expire`: raise TransferTimeout;
    `finish`: return as if the write landed). Never returning on its own models a
    transport that ignores its timeout."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.expire = threading.Event()
        self.finish = threading.Event()
        self.returned = threading.Event()
        self.calls = 0

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        self.calls += 1
        self.inside.set()
        try:
            while not self.finish.is_set():
                if self.expire.wait(0.01):
                    raise TransferTimeout(f"not landed within {timeout} s")
        finally:
            self.returned.set()

    def let_go(self) -> None:
        self.finish.set()


# -- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture
def transport() -> MemoryTransport:
    return MemoryTransport()


@pytest.fixture
def writers() -> Iterator[list[EngineWriter]]:
    """Write threads made by a test; closed afterwards (held peers must be let go first)."""
    made: list[EngineWriter] = []
    yield made
    for w in made:
        w.close()
    for w in made:
        assert not w._thread.is_alive(), f"write thread of {w.engine_id} did not stop"


def new_writer(writers: list[EngineWriter], engine: str, timeout: float = 2.0) -> EngineWriter:
    w = EngineWriter(engine, timeout)
    writers.append(w)
    return w


class Engine:
    """An engine rank's parameter memory, exposed with the transport."""

    def __init__(self, transport: MemoryTransport, nbytes: int, fill: int = 0xAB) -> None:
        self.memory = torch.full((nbytes,), fill, dtype=torch.uint8)
        transport.expose([self.memory])

    @property
    def addr(self) -> int:
        return self.memory.data_ptr()


def fill_random(lease: Lease, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lease.tensor.copy_(torch.randint(0, 256, lease.tensor.shape, dtype=torch.uint8, generator=g))
    return lease.tensor.clone()


def whole(lease: Lease, engine: Engine, nbytes: int) -> WriteBatch:
    batch = WriteBatch()
    batch.add(lease.addr, engine.addr, nbytes)
    return batch


def drain(writer: EngineWriter, margin: float = 5.0, limit: float = 10.0) -> None:
    """`writer.wait(margin)`, failing the test instead of hanging it should wait not return."""
    done = threading.Thread(target=writer.wait, kwargs={"margin": margin}, daemon=True)
    done.start()
    done.join(limit)
    if done.is_alive():
        pytest.fail(f"EngineWriter.wait(margin={margin}) of {writer.engine_id} did not return within {limit} s")
    assert writer._thread.is_alive(), f"the write thread of {writer.engine_id} died"


def names_target(error: str | None, engine: str, rank: int) -> bool:
    """Whether an engine's error starts by naming the target rank (as `engine[rank]`
    or as `engine 'engine' rank N`)."""
    e = re.escape(engine)
    return error is not None and re.match(rf"({e}\[{rank}\]|engine '{e}' rank {rank}): ", error) is not None


def is_free(pool: BufferPool, timeout: float = 1.0) -> bool:
    return pool.wait_all_free(timeout)


# -- WriteBatch ------------------------------------------------------------------------------


def test_write_batch_coalesces_contiguous_writes() -> None:
    b = WriteBatch()
    b.add(1000, 5000, 16)
    b.add(1016, 5016, 8)  # continues both ranges
    b.add(1024, 5024, 8)
    assert (b.local, b.remote, b.lengths) == ([1000], [5000], [32])
    assert b.nbytes == 32
    assert len(b) == 1


@pytest.mark.parametrize(
    ("local", "remote"),
    [
        (1040, 5032),  # gap on the local side only
        (1032, 5040),  # gap on the remote side only
        (1040, 5040),  # gap on both
        (900, 4900),  # before, not after
    ],
)
def test_write_batch_keeps_non_contiguous_writes_apart(local: int, remote: int) -> None:
    b = WriteBatch()
    b.add(1000, 5000, 32)
    b.add(local, remote, 8)
    assert (b.local, b.remote, b.lengths) == ([1000, local], [5000, remote], [32, 8])
    assert b.nbytes == 40
    assert len(b) == 2


def test_write_batch_ignores_empty_writes() -> None:
    b = WriteBatch()
    b.add(1000, 5000, 0)
    b.add(1000, 5000, -4)
    assert len(b) == 0 and b.nbytes == 0
    b.add(1000, 5000, 8)
    b.add(1008, 5008, 0)
    b.add(1008, 5008, 8)
    assert (b.local, b.remote, b.lengths) == ([1000], [5000], [16])


@st.composite
def scattered_writes(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Non-overlapping (local offset, remote offset, length) writes within 4 KiB,
    often back to back on one side or both."""
    writes = []
    local = remote = 0
    for _ in range(draw(st.integers(0, 20))):
        local += draw(st.sampled_from([0, 0, 0, 1, 7, 64]))
        remote += draw(st.sampled_from([0, 0, 0, 1, 5, 64]))
        length = draw(st.integers(1, 100))
        writes.append((local, remote, length))
        local += length
        remote += length
    return writes


@settings(max_examples=100, deadline=None)
@given(scattered_writes())
def test_write_batch_moves_the_same_bytes_as_the_writes_one_by_one(writes: list[tuple[int, int, int]]) -> None:
    t = MemoryTransport()
    pool = BufferPool(4096, t, count=1)
    lease = pool.acquire(1.0)
    fill_random(lease, seed=len(writes))
    engine = Engine(t, 4096)
    expected = engine.memory.clone()
    batch = WriteBatch()
    for local, remote, length in writes:
        batch.add(lease.addr + local, engine.addr + remote, length)
        expected[remote : remote + length] = lease.tensor[local : local + length]

    MemoryPeer(t).write(batch, timeout=1.0)

    assert torch.equal(engine.memory, expected)
    assert batch.nbytes == sum(w[2] for w in writes)
    assert len(batch) <= len(writes)
    for i in range(1, len(batch)):  # nothing left that could have been merged
        contiguous = batch.local[i - 1] + batch.lengths[i - 1] == batch.local[i]
        assert not (contiguous and batch.remote[i - 1] + batch.lengths[i - 1] == batch.remote[i])
    lease.release()
    pool.close()


# -- BufferPool ------------------------------------------------------------------------------


def test_pool_registers_two_buffers_once(transport: MemoryTransport) -> None:
    pool = BufferPool(4096, transport)
    addrs = [t.data_ptr() for t in pool.tensors]
    assert len(set(addrs)) == 2
    assert sorted(transport.register_calls) == sorted((a, 4096) for a in addrs)
    for _ in range(5):
        a, b = pool.acquire(1.0), pool.acquire(1.0)
        assert {a.addr, b.addr} == set(addrs)
        a.release()
        b.release()
    assert len(transport.register_calls) == 2
    pool.close()
    assert sorted(transport.unregister_calls) == sorted(addrs)
    assert transport.registered == {}


def test_pool_buffers_do_not_overlap(transport: MemoryTransport) -> None:
    pool = BufferPool(1000, transport)
    (a, n), (b, _) = sorted(transport.register_calls)
    assert n == 1000 and a + n <= b
    pool.close()


def test_pool_times_out_when_every_buffer_is_taken(transport: MemoryTransport) -> None:
    pool = BufferPool(64, transport)
    held = [pool.acquire(1.0), pool.acquire(1.0)]
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="no transfer buffer was released"):
        pool.acquire(0.05)
    assert time.monotonic() - start < 1.0
    assert not pool.wait_all_free(0.01)
    for lease in held:
        lease.release()
    assert pool.wait_all_free(0.01)


def test_pool_acquire_wakes_up_when_a_buffer_is_released(transport: MemoryTransport) -> None:
    pool = BufferPool(64, transport, count=1)
    lease = pool.acquire(1.0)
    threading.Timer(0.05, lease.release).start()
    again = pool.acquire(2.0)
    assert again.index == lease.index
    again.release()


def test_lease_counts_references(transport: MemoryTransport) -> None:
    pool = BufferPool(64, transport, count=1)
    lease = pool.acquire(1.0)
    lease.retain()
    lease.release()
    with pytest.raises(TransferTimeout):  # one reference still out
        pool.acquire(0.01)
    lease.release()
    with pytest.raises(RuntimeError, match="released more often"):
        lease.release()
    with pytest.raises(RuntimeError, match="released buffer lease"):
        lease.retain()


# -- EngineWriter ----------------------------------------------------------------------------


def test_writes_land_bit_for_bit(transport: MemoryTransport, writers: list[EngineWriter]) -> None:
    pool = BufferPool(1024, transport)
    engine = Engine(transport, 4096)
    expected = engine.memory.clone()
    writer = new_writer(writers, "engine-a")
    peer = MemoryPeer(transport)
    writer.start_update()
    for step in range(4):  # more buckets than buffers: buffers come back as writes finish
        lease = pool.acquire(2.0)
        data = fill_random(lease, seed=step)
        batch = WriteBatch()
        batch.add(lease.addr, engine.addr + step * 1024, 600)  # the rest is padding, left alone
        batch.add(lease.addr + 700, engine.addr + step * 1024 + 700, 100)
        expected[step * 1024 : step * 1024 + 600] = data[:600]
        expected[step * 1024 + 700 : step * 1024 + 800] = data[700:800]
        writer.submit(WriteJob(TargetId("engine-a", 0), peer, batch, lease))
        lease.release()
    drain(writer)
    assert writer.progress.error is None
    assert writer.progress.bytes == 4 * 700
    assert writer.progress.last_done is not None
    assert torch.equal(engine.memory, expected)
    assert is_free(pool)


def test_buffer_not_handed_out_while_a_write_reads_it(
    transport: MemoryTransport, writers: list[EngineWriter]
) -> None:
    """One filled buffer goes to two engines; it is free only once both writes released it."""
    pool = BufferPool(256, transport)
    engines = {e: Engine(transport, 256, fill=0) for e in ("engine-a", "engine-b")}
    gates = {e: threading.Event() for e in engines}
    peers = {e: MemoryPeer(transport, gates[e]) for e in engines}
    ws = {e: new_writer(writers, e) for e in engines}

    lease = pool.acquire(1.0)
    data = fill_random(lease, seed=1)
    for e, engine in engines.items():
        ws[e].submit(WriteJob(TargetId(e, 0), peers[e], whole(lease, engine, 256), lease))
    lease.release()  # the filler is done; the writes still hold it

    other = pool.acquire(1.0)
    assert other.index != lease.index
    with pytest.raises(TransferTimeout):
        pool.acquire(0.05)
    other.release()
    again = pool.acquire(1.0)
    assert again.index == other.index  # the buffer being written is not handed out
    with pytest.raises(TransferTimeout):
        pool.acquire(0.05)

    gates["engine-a"].set()
    drain(ws["engine-a"])
    assert torch.equal(engines["engine-a"].memory, data)
    with pytest.raises(TransferTimeout):  # engine-b still reads it
        pool.acquire(0.05)

    gates["engine-b"].set()
    drain(ws["engine-b"])
    assert torch.equal(engines["engine-b"].memory, data)
    freed = pool.acquire(1.0)
    assert freed.index == lease.index
    freed.release()
    again.release()
    assert is_free(pool)


def test_failed_engine_drops_later_jobs_and_releases_buffers(
    transport: MemoryTransport, writers: list[EngineWriter]
) -> None:
    pool = BufferPool(64, transport)
    peer = FailingPeer()
    writer = new_writer(writers, "engine-x")
    target = TargetId("engine-x", 3)
    leases = [pool.acquire(1.0), pool.acquire(1.0)]
    for lease in leases + leases + leases:
        writer.submit(WriteJob(target, peer, WriteBatch([lease.addr], [0], [64]), lease))
    for lease in leases:
        lease.release()
    drain(writer)
    assert peer.calls == 1
    assert writer.progress.error is not None
    assert names_target(writer.progress.error, "engine-x", 3), writer.progress.error
    assert "connection reset by peer" in writer.progress.error
    assert writer.progress.bytes == 0
    assert is_free(pool)


def test_failed_engine_keeps_its_first_error(transport: MemoryTransport, writers: list[EngineWriter]) -> None:
    pool = BufferPool(64, transport)
    peer = MemoryPeer(transport)
    engine = Engine(transport, 64, fill=7)
    writer = new_writer(writers, "engine-x")
    writer.start_update()
    writer.fail("pause failed: connection refused")
    writer.fail("something later")
    lease = pool.acquire(1.0)
    fill_random(lease, seed=3)
    writer.submit(WriteJob(TargetId("engine-x", 0), peer, whole(lease, engine, 64), lease))
    lease.release()
    drain(writer)
    assert peer.calls == 0
    assert writer.progress.error == "pause failed: connection refused"
    assert torch.equal(engine.memory, torch.full((64,), 7, dtype=torch.uint8))  # untouched
    assert is_free(pool)


def test_transport_bug_fails_the_engine_not_the_thread(
    transport: MemoryTransport, writers: list[EngineWriter]
) -> None:
    pool = BufferPool(64, transport)
    writer = new_writer(writers, "engine-x")
    target = TargetId("engine-x", 1)
    lease = pool.acquire(1.0)
    writer.submit(WriteJob(target, FailingPeer(KeyError("descriptor")), whole(lease, Engine(transport, 64), 64), lease))
    lease.release()
    drain(writer)
    assert names_target(writer.progress.error, "engine-x", 1), writer.progress.error
    assert writer.progress.error.endswith(": KeyError: 'descriptor'")

    # The next update starts clean on the same thread, and its writes land.
    writer.start_update()
    engine = Engine(transport, 64, fill=0)
    lease = pool.acquire(1.0)
    data = fill_random(lease, seed=5)
    writer.submit(WriteJob(target, MemoryPeer(transport), whole(lease, engine, 64), lease))
    lease.release()
    drain(writer)
    assert writer.progress.error is None
    assert writer.progress.bytes == 64
    assert torch.equal(engine.memory, data)
    assert is_free(pool)


def test_transport_error_names_the_target(transport: MemoryTransport, writers: list[EngineWriter]) -> None:
    """A write outside what the engine exposed is refused by the transport; the
    engine's error says which rank."""
    pool = BufferPool(64, transport)
    engine = Engine(transport, 32)
    writer = new_writer(writers, "engine-y")
    lease = pool.acquire(1.0)
    writer.submit(WriteJob(TargetId("engine-y", 5), MemoryPeer(transport), whole(lease, engine, 64), lease))
    lease.release()
    drain(writer)
    assert writer.progress.error is not None
    assert names_target(writer.progress.error, "engine-y", 5), writer.progress.error
    assert "is not exposed" in writer.progress.error
    assert is_free(pool)


def test_slow_engine_does_not_hold_up_another(transport: MemoryTransport, writers: list[EngineWriter]) -> None:
    """Both engines' writers read the same pool's buffers. While one engine's first
    write hangs, the other engine receives every bucket; then the slow write times
    out and only that engine is failed."""
    pool = BufferPool(128, transport)
    fast_engine = Engine(transport, 256, fill=0)
    fast = new_writer(writers, "fast")
    slow = new_writer(writers, "slow")
    fast_peer, slow_peer = MemoryPeer(transport), HeldPeer()
    slow_engine_addr = 0x1000  # never written: the slow write never lands

    expected = fast_engine.memory.clone()
    for step in range(2):
        lease = pool.acquire(1.0)
        data = fill_random(lease, seed=10 + step)
        expected[step * 128 : (step + 1) * 128] = data
        fast_batch = WriteBatch()
        fast_batch.add(lease.addr, fast_engine.addr + step * 128, 128)
        slow_batch = WriteBatch()
        slow_batch.add(lease.addr, slow_engine_addr + step * 128, 128)
        slow.submit(WriteJob(TargetId("slow", 0), slow_peer, slow_batch, lease))
        fast.submit(WriteJob(TargetId("fast", 0), fast_peer, fast_batch, lease))
        lease.release()

    try:
        drain(fast)
        assert slow_peer.inside.wait(2.0) and not slow_peer.returned.is_set()  # still stuck in its first write
        assert fast.progress.error is None
        assert fast.progress.bytes == 256
        assert torch.equal(fast_engine.memory, expected)
        with pytest.raises(TransferTimeout):  # the slow engine still holds the buffers
            pool.acquire(0.02)
    finally:
        slow_peer.expire.set()
    drain(slow)
    assert slow_peer.calls == 1  # its second bucket was dropped
    assert slow.progress.error is not None
    assert names_target(slow.progress.error, "slow", 0), slow.progress.error
    assert "not landed" in slow.progress.error
    assert slow.progress.bytes == 0
    assert fast.progress.error is None
    assert is_free(pool)


def test_write_that_times_out_fails_the_engine(transport: MemoryTransport, writers: list[EngineWriter]) -> None:
    pool = BufferPool(64, transport)
    peer = SleepyPeer()
    writer = new_writer(writers, "engine-z", timeout=0.1)
    lease = pool.acquire(1.0)
    for _ in range(3):
        writer.submit(WriteJob(TargetId("engine-z", 2), peer, WriteBatch([lease.addr], [0], [64]), lease))
    lease.release()
    start = time.monotonic()
    drain(writer, margin=5.0)
    assert time.monotonic() - start < 2.0  # one timeout, not three
    assert peer.calls == 1
    assert writer.progress.error is not None
    assert names_target(writer.progress.error, "engine-z", 2), writer.progress.error
    assert "not landed after 0.1 s" in writer.progress.error
    assert is_free(pool)


def test_wait_gives_up_on_a_write_that_never_returns(
    transport: MemoryTransport, writers: list[EngineWriter]
) -> None:
    """A transport that ignores its timeout: `wait` fails the engine once the write
    overran timeout + margin, returns, and gives back the buffers its jobs hold."""
    pool = BufferPool(64, transport)
    peer = HeldPeer()
    writer = new_writer(writers, "engine-h", timeout=0.1)
    target = TargetId("engine-h", 0)
    lease = pool.acquire(1.0)
    for _ in range(3):
        writer.submit(WriteJob(target, peer, WriteBatch([lease.addr], [0], [64]), lease))
    lease.release()
    start = time.monotonic()
    try:
        drain(writer, margin=0.2)
        waited = time.monotonic() - start
        assert 0.3 <= waited < 2.0
        assert writer.progress.error == "a write did not return within 0.3 s"
        assert not peer.returned.is_set()  # still inside the transport...
        assert pool.wait_all_free(0.01)  # ...but it no longer holds the buffer back
    finally:
        peer.let_go()  # the write returns late: the rest of the queue is dropped
    assert peer.returned.wait(2.0)
    drain(writer)
    assert peer.calls == 1
    assert writer.progress.error == "a write did not return within 0.3 s"
    assert is_free(pool)
    lease = pool.acquire(1.0)  # the late releases did not count twice
    lease.release()
    assert is_free(pool)


def test_stalled_pool_abandons_the_engine_holding_it(transport: MemoryTransport, writers: list[EngineWriter]) -> None:
    """Both buffers are held by one engine's hung writes; a sender that needs a buffer
    for another engine fails the laggard (`on_stall`) and goes on."""
    pool = BufferPool(64, transport)
    held = HeldPeer()
    slow = new_writer(writers, "slow", timeout=30.0)
    fast = new_writer(writers, "fast")
    engine = Engine(transport, 64, fill=0)
    try:
        for _ in range(2):
            lease = pool.acquire(1.0)
            slow.submit(WriteJob(TargetId("slow", 0), held, WriteBatch([lease.addr], [0], [64]), lease))
            lease.release()
        assert held.inside.wait(2.0)
        stalls: list[float] = []

        def on_stall(since: float) -> None:
            stalls.append(since)
            for w in (slow, fast):
                if w.holds_since(since):
                    w.abandon(f"{w.engine_id} held back the other engines")

        assert slow.holds_since(time.monotonic()) and not fast.holds_since(time.monotonic())
        lease = pool.acquire(0.05, on_stall)
        assert len(stalls) == 1
        assert slow.progress.error == "slow held back the other engines"
        assert not slow.holds_since(time.monotonic())
        data = fill_random(lease, seed=21)
        fast.submit(WriteJob(TargetId("fast", 0), MemoryPeer(transport), whole(lease, engine, 64), lease))
        lease.release()
        drain(fast)
        assert fast.progress.error is None
        assert torch.equal(engine.memory, data)
    finally:
        held.let_go()
    drain(slow)
    assert held.calls == 1
    assert is_free(pool)


def test_stalled_pool_without_a_laggard_still_times_out(transport: MemoryTransport) -> None:
    pool = BufferPool(64, transport, count=1)
    lease = pool.acquire(1.0)  # held by the filler itself, not by a write
    stalls: list[float] = []
    with pytest.raises(TransferTimeout):
        pool.acquire(0.05, stalls.append)
    assert len(stalls) == 1
    lease.release()


def test_write_job_release_is_idempotent(transport: MemoryTransport) -> None:
    pool = BufferPool(64, transport, count=1)
    lease = pool.acquire(1.0)
    lease.retain()
    job = WriteJob(TargetId("e", 0), MemoryPeer(transport), WriteBatch(), lease)
    job.release()
    job.release()  # an abandoned job that finishes later
    assert not pool.wait_all_free(0.01)  # the filler's reference is still out
    lease.release()
    assert is_free(pool)


def test_wait_returns_at_once_when_nothing_was_submitted(writers: list[EngineWriter]) -> None:
    writer = new_writer(writers, "idle")
    start = time.monotonic()
    drain(writer)
    assert time.monotonic() - start < 0.5
    assert writer.progress.error is None and writer.progress.bytes == 0


def test_after_runs_once_the_bytes_landed_and_before_the_next_job(
    transport: MemoryTransport, writers: list[EngineWriter]
) -> None:
    """A delta patch's apply call (`WriteJob.after`) sees its bytes landed, runs before
    the engine's next write, and when it fails, fails the engine and drops what follows."""
    pool = BufferPool(64, transport)
    engine = Engine(transport, 64, fill=0)
    writer = new_writer(writers, "engine-a")
    writer.start_update()
    seen: list[bytes] = []

    def apply(step: int) -> None:
        seen.append(engine.memory.numpy().tobytes())
        if step == 1:
            raise ControlError("engine 'engine-a' rank 0: patch answered 500")

    leases = []
    for step in range(3):
        lease = pool.acquire(1.0)
        leases.append(fill_random(lease, seed=step))
        job = WriteJob(TargetId("engine-a", 0), MemoryPeer(transport), whole(lease, engine, 64), lease)
        job.after = lambda step=step: apply(step)
        writer.submit(job)
        lease.release()
        if step == 0:
            drain(writer)
    drain(writer)
    assert seen == [leases[0].numpy().tobytes(), leases[1].numpy().tobytes()]  # each after its own write
    assert writer.progress.error == "engine 'engine-a' rank 0: patch answered 500"
    assert writer.progress.bytes == 64  # the failed apply's write does not count as delivered
    assert torch.equal(engine.memory, leases[1])  # the third job was dropped
    assert is_free(pool)


def test_a_write_stuck_past_its_update_does_not_hold_back_the_next(
    transport: MemoryTransport, writers: list[EngineWriter]
) -> None:
    """Mooncake's write call can block past its timeout on a connection TCP still retransmits
    on: once the update gave that engine up, the next one writes through a new thread, at once,
    and the old thread ends when the stuck call returns."""
    pool = BufferPool(64, transport)
    engine = Engine(transport, 64)
    stuck, good = HeldPeer(), MemoryPeer(transport)
    conn = Connection({"e": []}, writers={"e": new_writer(writers, "e", timeout=0.1)})
    old = conn.writers["e"]
    target = TargetId("e", 0)
    lease = pool.acquire(1.0)
    old.submit(WriteJob(target, stuck, whole(lease, engine, 64), lease))
    lease.release()
    assert stuck.inside.wait(2.0)
    drain(old, margin=0.1)  # the update gives the engine up; the call is still inside the transport
    try:
        conn.unstick_writers()
        new = conn.writers["e"]
        assert new is not old and not new.busy
        writers.append(new)
        lease = pool.acquire(1.0)
        sent = fill_random(lease, seed=5)
        new.start_update()
        new.submit(WriteJob(target, good, whole(lease, engine, 64), lease))
        lease.release()
        drain(new, limit=2.0)
        assert new.progress.error is None and torch.equal(engine.memory, sent)
        conn.unstick_writers()  # an idle writer is kept
        assert conn.writers["e"] is new
    finally:
        stuck.let_go()
    old._thread.join(2.0)
    assert not old._thread.is_alive(), "the stuck writer's thread did not end once its call returned"
