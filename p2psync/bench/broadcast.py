"""The broadcast path of miles, slime and verl, built as well as torch.distributed allows:
trainer rank 0 packs each gathered bucket into one flat buffer (casting to the engines'
dtype as it copies) and broadcasts it with one gloo broadcast to every engine rank, whose
own loader keeps its shard.

The group is a standalone gloo group of trainer rank 0 (group rank 0) and engine-rank
process `i` (group rank 1 + i), built on the job's rendezvous store; the trainer's default
process group is left alone, so the next bucket's gathers (on the trainer's group) run
while this bucket's broadcast is in flight. Two flat buffers on each side: rank 0 fills one
while the other is on the wire; an engine rank receives the next bucket into one while its
loader reads the other. The group also carries the bench's commands to the engines:
receive an update, zero the parameters (so that a verification after the next update
proves that update delivered them), report what they measured, or stop.

What each member's group threads wrote to their sockets is measured (see `wire`): the
bytes the broadcast really sent, relays included.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core.report import PhaseClock
from ..core.types import ParamSpec, dtype_size, numel
from .wire import ThreadBytes

if TYPE_CHECKING:
    import torch

    from ..core.rendezvous import Rendezvous

ORDER_KEY = "bench/broadcast/order"
STATS_KEY = "bench/broadcast/engine/{index}"
Load = Callable[[Sequence[tuple[str, "torch.Tensor"]]], None]
UPDATE, ZERO, STOP = 1, 2, 3
#: Tensors start at multiples of this in a flat buffer, so that every dtype view is aligned.
ALIGN = 64


@dataclass(frozen=True)
class Slot:
    """One tensor in a bucket's flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int


def pack(specs: Mapping[str, ParamSpec], buckets: Sequence[Sequence[str]], dtype: str | None) -> list[list[Slot]]:
    """Where each tensor of each bucket goes in its flat buffer, sent in `dtype` (None: the trainer's)."""
    packed = []
    for names in buckets:
        slots, offset = [], 0
        for name in names:
            spec = specs[name]
            sent = dtype or spec.dtype
            slots.append(Slot(name, spec.shape, sent, offset))
            offset += -(-numel(spec.shape) * dtype_size(sent) // ALIGN) * ALIGN
        packed.append(slots)
    return packed


def flat_bytes(slots: Sequence[Slot]) -> int:
    last = slots[-1]
    return last.offset + numel(last.shape) * dtype_size(last.dtype)


def _view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    import torch

    nbytes = numel(slot.shape) * dtype_size(slot.dtype)
    return flat[slot.offset : slot.offset + nbytes].view(getattr(torch, slot.dtype)).view(slot.shape)


def _join(rendezvous: Rendezvous, rank: int, members: int, timeout: float) -> tuple[Any, ThreadBytes]:
    """The gloo group (trainer rank 0 as 0, engine-rank process i as 1 + i) and its threads."""
    import torch.distributed as dist

    store = dist.PrefixStore("bench/broadcast/gloo", rendezvous.store)
    return ThreadBytes.started_by(lambda: dist.ProcessGroupGloo(store, rank, 1 + members, timedelta(seconds=timeout)))


def _broadcast(pg: Any, tensor: torch.Tensor) -> Any:
    """Start broadcasting `tensor` from group rank 0; return the work."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def _command(pg: Any, command: int = 0) -> int:
    """Trainer rank 0's command, on every member of the group."""
    import torch

    box = torch.tensor([command])
    _broadcast(pg, box).wait()
    return int(box.item())


def _buffers(packed: Sequence[Sequence[Slot]]) -> list[torch.Tensor]:
    import torch

    size = max(flat_bytes(slots) for slots in packed)
    return [torch.empty(size, dtype=torch.uint8) for _ in range(2)]


class Leader:
    """Trainer rank 0's side: publishes the packing, joins the group, sends updates and commands."""

    def __init__(
        self, rendezvous: Rendezvous, specs: Mapping[str, ParamSpec], buckets: Sequence[Sequence[str]],
        dtype: str | None, members: int, timeout: float,
    ) -> None:
        self.packed = pack(specs, buckets, dtype)
        order = [[[s.name, list(s.shape), s.dtype, s.offset] for s in slots] for slots in self.packed]
        rendezvous.set(ORDER_KEY, json.dumps(order))
        self.members = members
        self.rendezvous = rendezvous
        self.pg, self.threads = _join(rendezvous, 0, members, timeout)
        self.flat = _buffers(self.packed)
        #: Bytes this rank's group threads wrote in the last update.
        self.sent_bytes = 0

    @property
    def flat_buffer_bytes(self) -> int:
        return sum(t.numel() for t in self.flat)

    def send(
        self, gather: Callable[[Sequence[str]], Mapping[str, torch.Tensor]], clock: PhaseClock,
        progress: Callable[[], object],
    ) -> None:
        """One update: gather each bucket (collective: the other trainer ranks call `follow`),
        pack it into a free flat buffer and start its broadcast; returns once every engine
        rank loaded it."""
        before = self.threads.written()
        _command(self.pg, UPDATE)
        clock.lap("command")
        works: list[Any] = [None, None]
        for i, slots in enumerate(self.packed):
            tensors = gather([s.name for s in slots])
            clock.lap("gather")
            if works[i % 2] is not None:
                works[i % 2].wait()
                clock.lap("buffer_wait")
            flat = self.flat[i % 2]
            for slot in slots:
                _view(flat, slot).copy_(tensors[slot.name])  # casts to the dtype sent
            del tensors
            clock.lap("produce")
            works[i % 2] = _broadcast(self.pg, flat[: flat_bytes(slots)])
            progress()
        for work in works:
            if work is not None:
                work.wait()
        clock.lap("drain")
        self.pg.barrier().wait()  # every engine rank has loaded the last bucket
        clock.lap("engine_load")
        self.sent_bytes = self.threads.written() - before

    def zero(self) -> None:
        """Have every engine zero its parameters; returns once they did."""
        _command(self.pg, ZERO)
        self.pg.barrier().wait()

    def stop(self, timeout: float) -> list[dict[str, list[float]]]:
        """Release the engines; return what each engine-rank process measured in each update
        (`load_seconds`, `sent_bytes`), in group order."""
        _command(self.pg, STOP)
        keys = [STATS_KEY.format(index=i) for i in range(self.members)]
        return [json.loads(self.rendezvous.get(key, timeout=timeout)) for key in keys]


def follow(
    gather: Callable[[Sequence[str]], object], buckets: Sequence[Sequence[str]], progress: Callable[[], object]
) -> None:
    """The other trainer ranks' side of `Leader.send`: the same gathers, in the same order."""
    for names in buckets:
        gather(names)
        progress()


def _receive_update(pg: Any, load: Load, packed: Sequence[Sequence[Slot]], flat: Sequence[torch.Tensor]) -> float:
    """One update on an engine rank: receive each bucket into a free flat buffer (the next
    one's receive runs while the loader reads this one); return the seconds in the loader."""
    loading = 0.0
    work = _broadcast(pg, flat[0][: flat_bytes(packed[0])])
    for i, slots in enumerate(packed):
        work.wait()
        if i + 1 < len(packed):
            work = _broadcast(pg, flat[(i + 1) % 2][: flat_bytes(packed[i + 1])])
        start = time.monotonic()
        load([(s.name, _view(flat[i % 2], s)) for s in slots])
        loading += time.monotonic() - start
    pg.barrier().wait()
    return loading


@dataclass
class EngineStats:
    load_seconds: list[float] = field(default_factory=list)
    sent_bytes: list[int] = field(default_factory=list)


def engine_loop(
    rendezvous: Rendezvous, index: int, members: int, params: Mapping[str, torch.Tensor], load: Load, done: Any,
    timeout: float,
) -> None:
    """Engine-rank process `index` of `members`: wait for the trainer's packing (or for `done`
    to be set), join the group, and follow trainer rank 0's commands until told to stop;
    `load` takes each received bucket, `params` are zeroed on command. At the stop, publishes
    what it measured in each update."""
    while not rendezvous.store.check([ORDER_KEY]):
        if done.wait(0.2):
            return
    packed = [[Slot(n, tuple(shape), dtype, offset) for n, shape, dtype, offset in b]
              for b in json.loads(rendezvous.get(ORDER_KEY))]
    pg, threads = _join(rendezvous, 1 + index, members, timeout)
    flat = _buffers(packed)
    stats = EngineStats()
    while (command := _command(pg)) != STOP:
        if command == UPDATE:
            before = threads.written()
            stats.load_seconds.append(_receive_update(pg, load, packed, flat))
            stats.sent_bytes.append(threads.written() - before)
        elif command == ZERO:
            for tensor in params.values():
                tensor.zero_()
            pg.barrier().wait()
    rendezvous.set(STATS_KEY.format(index=index), json.dumps(stats.__dict__))
