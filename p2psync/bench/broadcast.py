"""The broadcast path of miles, slime and verl: trainer rank 0 gathers each bucket of full
tensors, casts them to the engines' dtype and broadcasts every tensor with
torch.distributed to every engine rank, which loads it (keeping its shard).

The broadcast group is a standalone gloo group of trainer rank 0 (group rank 0) and
engine-rank process `i` (group rank 1 + i), built on the job's rendezvous store; the
trainer's default process group is left alone. Engine ranks learn the tensors (name,
shape, dtype sent) from the rendezvous, then follow the commands trainer rank 0
broadcasts: receive an update (each bucket into fresh tensors, then handed to the
rank's loader: a torch engine copies, an sglang rank runs its `load_weights`), zero
the parameters (so that a verification after the next update proves that update
delivered them), or stop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core.buckets import make_buckets
from ..core.layout import ParamGroup
from ..core.types import ParamSpec, numel

if TYPE_CHECKING:
    import torch

    from ..core.rendezvous import Rendezvous
    from ..core.source import TrainerSource

ORDER_KEY = "bench/broadcast/order"
Load = Callable[[Sequence[tuple[str, "torch.Tensor"]]], None]
UPDATE, ZERO, STOP = 1, 2, 3


def buckets_of(source: TrainerSource, bucket_bytes: int) -> list[list[str]]:
    """The trainer's HF tensors in gather order, packed up to `bucket_bytes`."""
    specs = source.param_specs()
    return make_buckets(specs, [ParamGroup((s.name,), (s.name,), s.nbytes) for s in specs], bucket_bytes)


def sent_bytes(source: TrainerSource, dtype: str | None) -> int:
    """Bytes of one copy of every HF tensor in the dtype the broadcast sends (`None`: the trainer's)."""
    import torch

    def size(spec: ParamSpec) -> int:
        return spec.nbytes if dtype is None else numel(spec.shape) * getattr(torch, dtype).itemsize

    return sum(size(s) for s in source.param_specs())


def sends_per_member(size: int) -> list[int]:
    """How many copies of the payload each group rank sends in gloo's broadcast from rank 0
    (a binomial tree: with more than two receivers, some receivers relay)."""
    dim = (size - 1).bit_length()
    sends = [0] * size
    for rank in range(size):
        for i in range(dim):
            if rank < (1 << i) and rank + (1 << i) < size:  # step i: ranks below 2**i send to rank + 2**i
                sends[rank] += 1
    return sends


def leader_group(
    rendezvous: Rendezvous, source: TrainerSource, buckets: Sequence[Sequence[str]], dtype: str | None,
    members: int, timeout: float,
) -> Any:
    """On trainer rank 0: publish the tensors (name, shape, dtype sent) bucket by bucket and
    join the broadcast group."""
    specs = {s.name: s for s in source.param_specs()}
    order = [[[n, list(specs[n].shape), dtype or specs[n].dtype] for n in names] for names in buckets]
    rendezvous.set(ORDER_KEY, json.dumps(order))
    return _group(rendezvous, 0, members, timeout)


def _group(rendezvous: Rendezvous, rank: int, members: int, timeout: float) -> Any:
    """The gloo broadcast group: trainer rank 0 joins as 0, engine-rank process i of `members`
    as 1 + i. Blocks until all joined."""
    import torch.distributed as dist

    store = dist.PrefixStore("bench/broadcast/gloo", rendezvous.store)
    return dist.ProcessGroupGloo(store, rank, 1 + members, timedelta(seconds=timeout))


def _broadcast(pg: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Broadcast every tensor from group rank 0, all in flight at once; wait for all."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for work in [pg.broadcast([t], opts) for t in tensors]:
        work.wait()


def _command(pg: Any, command: int = 0) -> int:
    """Trainer rank 0's command, on every member of the group."""
    import torch

    box = torch.tensor([command])
    _broadcast(pg, [box])
    return int(box.item())


def zero(pg: Any) -> None:
    """On trainer rank 0: have every engine zero its parameters; returns once they did."""
    _command(pg, ZERO)
    pg.barrier().wait()


def stop(pg: Any) -> None:
    """On trainer rank 0: release the engines from the broadcast loop."""
    _command(pg, STOP)


def send_update(
    source: TrainerSource, buckets: Sequence[Sequence[str]], pg: Any | None, progress: Callable[[], object],
    dtype: str | None = None,
) -> None:
    """One update from the trainer side. Every trainer rank gathers (a collective);
    the rank holding `pg` casts to `dtype` and broadcasts. Returns once the engines hold every tensor."""
    import torch

    cast = None if dtype is None else getattr(torch, dtype)
    if pg is not None:
        _command(pg, UPDATE)
    for names in buckets:
        tensors = source.gather(names)
        if pg is not None:
            _broadcast(pg, [tensors[n].to(cast).contiguous() for n in names])
        del tensors
        progress()
    if pg is not None:
        pg.barrier().wait()


def timed_update(
    source: TrainerSource, buckets: Sequence[Sequence[str]], pg: Any | None, progress: Callable[[], object],
    dtype: str | None = None,
) -> float:
    """Seconds of one broadcast update, from after a trainer barrier until the engines hold
    it (on the rank with `pg`); with `pg` None on every rank, of the gathers alone."""
    import torch.distributed as dist

    dist.barrier()
    start = time.monotonic()
    send_update(source, buckets, pg, progress, dtype)
    return time.monotonic() - start


def _receive_update(pg: Any, load: Load, buckets: Sequence[Sequence[tuple[str, list[int], str]]]) -> None:
    """One update on an engine rank: receive each bucket into fresh tensors and load them."""
    import torch

    for tensors in buckets:
        received = [torch.empty(shape, dtype=getattr(torch, dtype)) for _, shape, dtype in tensors]
        _broadcast(pg, received)
        load([(name, tensor) for (name, _, _), tensor in zip(tensors, received)])
    pg.barrier().wait()


def engine_loop(
    rendezvous: Rendezvous, index: int, members: int, params: Mapping[str, torch.Tensor], load: Load, done: Any,
    timeout: float,
) -> None:
    """Engine-rank process `index` of `members`: wait for the trainer's tensors (or for `done`
    to be set), join the group, and follow trainer rank 0's commands until told to stop;
    `load` takes each received bucket, `params` are zeroed on command."""
    while not rendezvous.store.check([ORDER_KEY]):
        if done.wait(0.2):
            return
    buckets = json.loads(rendezvous.get(ORDER_KEY))
    pg = _group(rendezvous, 1 + index, members, timeout)
    while (command := _command(pg)) != STOP:
        if command == UPDATE:
            _receive_update(pg, load, buckets)
        elif command == ZERO:
            for tensor in params.values():
                tensor.zero_()
            pg.barrier().wait()
