"""The broadcast path of miles, slime and verl, built as well as torch.distributed allows:
trainer rank 0 packs each gathered bucket into one flat buffer (casting to the engines'
dtype as it copies) and broadcasts it with one gloo broadcast to every engine rank, whose
own loader keeps its shard. For fp8 engines rank 0 first quantizes the HF tensors the engines
hold in fp8 (`Quantized`) and packs the fp8 checkpoint's weight and scale instead.

The group is a standalone gloo group of trainer rank 0 (group rank 0) and engine-rank
process `i` (group rank 1 + i), built on the job's rendezvous store; the trainer's default
process group is left alone, so the next bucket's gathers (on the trainer's group) run
while this bucket's broadcast is in flight. Two flat buffers on each side: rank 0 fills one
while the other is on the wire; an engine rank receives the next bucket into one while its
loader reads the other. The group also carries the bench's commands to the engines:
receive an update, zero the parameters (so that a verification after the next update
proves that update delivered them), report what they measured, or stop.

Two ways of broadcasting a bucket: gloo's own broadcast (`tree`), and a pipelined chain
(`chain`, as NCCL's ring broadcast): trainer rank 0 sends each piece of the bucket to group
rank 1, which forwards it to 2 as soon as it arrived, and so on; every member's link carries
the bytes once, and the pieces fill the chain in one piece's time. On a cluster's links the
better of the two is the broadcast to beat.

What each member's group threads wrote to their sockets is measured (see `wire`): the
bytes the broadcast really sent, relays included.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..core.report import PhaseClock
from ..core.types import ParamSpec, dtype_size, numel
from .wire import ThreadBytes

if TYPE_CHECKING:
    import torch

    from ..core.rendezvous import Rendezvous
    from ..layouts.quantizers import Quantizer

ORDER_KEY = "bench/broadcast/order"
STATS_KEY = "bench/broadcast/engine/{index}"
Load = Callable[[Sequence[tuple[str, "torch.Tensor"]]], None]
UPDATE, ZERO, STOP, UPDATE_CHAIN = 1, 2, 3, 4
#: How a bucket is broadcast: gloo's own broadcast, or the pipelined chain.
Mode = Literal["tree", "chain"]
#: The chain's piece: small enough that the chain fills fast (its last member starts one piece per
#: link after the first), large enough that a message's own cost is noise beside its bytes.
CHAIN_PIECE_BYTES = 4 << 20
#: Tensors start at multiples of this in a flat buffer, so that every dtype view is aligned.
ALIGN = 64


@dataclass(frozen=True)
class Slot:
    """One tensor in a bucket's flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int


@dataclass(frozen=True)
class Quantized:
    """The HF tensors an fp8 engine holds quantized (`names`), sent as the fp8 checkpoint's weight
    and scale that `quantizer` makes of each after a cast to `dtype`, as the p2psync layouts make
    them (`QuantizedLayout`, whose decision this is)."""

    names: frozenset[str]
    quantizer: Quantizer
    dtype: torch.dtype

    def sent(self, spec: ParamSpec) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of the fp8 weight and the scale sent for HF tensor `spec`."""
        scale = self.quantizer.scale_name(spec.name)
        return [(spec.name, spec.shape, "float8_e4m3fn"), (scale, self.quantizer.scale_shape(spec.shape), "float32")]

    def quantize(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors`, those in `names` replaced by their fp8 weight and scale."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if name in self.names:
                out.update(self.quantizer.quantize_from(name, tensor, self.dtype))
            else:
                out[name] = tensor
        return out


def pack(
    specs: Mapping[str, ParamSpec], buckets: Sequence[Sequence[str]], dtype: str | None,
    quantized: Quantized | None = None,
) -> list[list[Slot]]:
    """Where each tensor of each bucket goes in its flat buffer, sent in `dtype` (None: the
    trainer's), or, where `quantized` names it, as its fp8 weight and scale."""
    packed = []
    for names in buckets:
        slots, offset = [], 0
        for name in names:
            spec = specs[name]
            if quantized is not None and name in quantized.names:
                sent = quantized.sent(spec)
            else:
                sent = [(name, spec.shape, dtype or spec.dtype)]
            for tensor, shape, sent_dtype in sent:
                slots.append(Slot(tensor, shape, sent_dtype, offset))
                offset += -(-numel(shape) * dtype_size(sent_dtype) // ALIGN) * ALIGN
        packed.append(slots)
    return packed


def flat_bytes(slots: Sequence[Slot]) -> int:
    last = slots[-1]
    return last.offset + numel(last.shape) * dtype_size(last.dtype)


def _view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    import torch

    nbytes = numel(slot.shape) * dtype_size(slot.dtype)
    return flat[slot.offset : slot.offset + nbytes].view(getattr(torch, slot.dtype)).view(slot.shape)


class Work(Protocol):
    def wait(self) -> object: ...


class Group:
    """The gloo group (trainer rank 0 as 0, engine-rank process i as 1 + i), with a relay thread
    for the chain, and the bytes its threads (gloo's and the relay's) wrote."""

    def __init__(self, rendezvous: Rendezvous, rank: int, members: int, timeout: float) -> None:
        import torch.distributed as dist

        store = dist.PrefixStore("bench/broadcast/gloo", rendezvous.store)
        self.rank, self.size = rank, 1 + members
        self.pg: Any
        self.pg, gloo = ThreadBytes.started_by(
            lambda: dist.ProcessGroupGloo(store, rank, self.size, timedelta(seconds=timeout))
        )
        self._relay = ThreadPoolExecutor(max_workers=1, thread_name_prefix="broadcast-relay")
        _, relay = ThreadBytes.started_by(lambda: self._relay.submit(lambda: None).result())
        self.threads = ThreadBytes(gloo.tids | relay.tids)

    def start(self, tensor: torch.Tensor, mode: Mode) -> Work:
        """Start broadcasting `tensor` from group rank 0; return the work."""
        if mode == "tree":
            return _broadcast(self.pg, tensor)
        return _Relayed(self._relay.submit(self._chain, tensor))

    def _chain(self, tensor: torch.Tensor) -> None:
        """This member's part of the chain: receive each piece from the previous member and send
        it on to the next as soon as it is here (the first member only sends, the last only
        receives)."""
        pieces = tensor.split(CHAIN_PIECE_BYTES)
        before, after = self.rank - 1, self.rank + 1
        arrivals = [self.pg.recv([piece], before, tag) for tag, piece in enumerate(pieces)] if before >= 0 else []
        sends = []
        for tag, piece in enumerate(pieces):
            if arrivals:
                arrivals[tag].wait()
            if after < self.size:
                sends.append(self.pg.send([piece], after, tag))
        for send in sends:
            send.wait()

    def barrier(self) -> None:
        self.pg.barrier().wait()


@dataclass(frozen=True)
class _Relayed:
    """A relay thread's part of the chain, as a work."""

    future: Future[None]

    def wait(self) -> object:
        return self.future.result()


def _broadcast(pg: Any, tensor: torch.Tensor) -> Any:
    """Start broadcasting `tensor` from group rank 0; return the work."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def _command(group: Group, command: int = 0) -> int:
    """Trainer rank 0's command, on every member of the group."""
    import torch

    box = torch.tensor([command])
    _broadcast(group.pg, box).wait()
    return int(box.item())


def _buffers(packed: Sequence[Sequence[Slot]]) -> list[torch.Tensor]:
    import torch

    size = max(flat_bytes(slots) for slots in packed)
    return [torch.empty(size, dtype=torch.uint8) for _ in range(2)]


class Leader:
    """Trainer rank 0's side: publishes the packing, joins the group, sends updates and commands."""

    def __init__(
        self, rendezvous: Rendezvous, specs: Mapping[str, ParamSpec], buckets: Sequence[Sequence[str]],
        dtype: str | None, members: int, timeout: float, quantized: Quantized | None = None,
    ) -> None:
        self.buckets = [list(names) for names in buckets]
        self.packed = pack(specs, buckets, dtype, quantized)
        self.quantized = quantized
        order = [[[s.name, list(s.shape), s.dtype, s.offset] for s in slots] for slots in self.packed]
        rendezvous.set(ORDER_KEY, json.dumps(order))
        self.members = members
        self.rendezvous = rendezvous
        self.group = Group(rendezvous, 0, members, timeout)
        self.flat = _buffers(self.packed)
        #: Bytes this rank's group threads wrote in the last update.
        self.sent_bytes = 0

    @property
    def flat_buffer_bytes(self) -> int:
        return sum(t.numel() for t in self.flat)

    def send(
        self, gather: Callable[[Sequence[str]], Mapping[str, torch.Tensor]], clock: PhaseClock,
        progress: Callable[[], object], mode: Mode = "tree",
    ) -> None:
        """One update: gather each bucket (collective: the other trainer ranks call `follow`),
        pack it into a free flat buffer and start its broadcast (`mode`); returns once every
        engine rank loaded it."""
        before = self.group.threads.written()
        _command(self.group, UPDATE if mode == "tree" else UPDATE_CHAIN)
        clock.lap("command")
        works: list[Work | None] = [None, None]
        for i, slots in enumerate(self.packed):
            tensors = gather(self.buckets[i])
            clock.lap("gather")
            pending = works[i % 2]
            if pending is not None:
                pending.wait()
                clock.lap("buffer_wait")
            flat = self.flat[i % 2]
            if self.quantized is not None:
                tensors = self.quantized.quantize(tensors)  # on the trainer, as RL frameworks do
            for slot in slots:
                _view(flat, slot).copy_(tensors[slot.name])  # casts to the dtype sent
            del tensors
            clock.lap("produce")
            works[i % 2] = self.group.start(flat[: flat_bytes(slots)], mode)
            progress()
        for work in works:
            if work is not None:
                work.wait()
        clock.lap("drain")
        self.group.barrier()  # every engine rank has loaded the last bucket
        clock.lap("engine_load")
        self.sent_bytes = self.group.threads.written() - before

    def zero(self) -> None:
        """Have every engine zero its parameters; returns once they did."""
        _command(self.group, ZERO)
        self.group.barrier()

    def stop(self, timeout: float) -> list[dict[str, list[float]]]:
        """Release the engines; return what each engine-rank process measured in each update
        (`load_seconds`, `sent_bytes`), in group order."""
        _command(self.group, STOP)
        keys = [STATS_KEY.format(index=i) for i in range(self.members)]
        return [json.loads(self.rendezvous.get(key, timeout=timeout)) for key in keys]


def follow(
    gather: Callable[[Sequence[str]], object], buckets: Sequence[Sequence[str]], progress: Callable[[], object]
) -> None:
    """The other trainer ranks' side of `Leader.send`: the same gathers, in the same order."""
    for names in buckets:
        gather(names)
        progress()


def _receive_update(
    group: Group, load: Load, packed: Sequence[Sequence[Slot]], flat: Sequence[torch.Tensor], mode: Mode
) -> float:
    """One update on an engine rank: receive each bucket into a free flat buffer (the next
    one's receive runs while the loader reads this one); return the seconds in the loader."""
    loading = 0.0
    work = group.start(flat[0][: flat_bytes(packed[0])], mode)
    for i, slots in enumerate(packed):
        work.wait()
        if i + 1 < len(packed):
            work = group.start(flat[(i + 1) % 2][: flat_bytes(packed[i + 1])], mode)
        start = time.monotonic()
        load([(s.name, _view(flat[i % 2], s)) for s in slots])
        loading += time.monotonic() - start
    group.barrier()
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
    group = Group(rendezvous, 1 + index, members, timeout)
    flat = _buffers(packed)
    stats = EngineStats()
    while (command := _command(group)) != STOP:
        if command in (UPDATE, UPDATE_CHAIN):
            before = group.threads.written()
            mode: Mode = "tree" if command == UPDATE else "chain"
            stats.load_seconds.append(_receive_update(group, load, packed, flat, mode))
            stats.sent_bytes.append(group.threads.written() - before)
        elif command == ZERO:
            for tensor in params.values():
                tensor.zero_()
            group.barrier()
    rendezvous.set(STATS_KEY.format(index=index), json.dumps(stats.__dict__))
