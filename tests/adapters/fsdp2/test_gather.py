"""FSDP2 gathers: all-at-once dim-0 gathers equal the full tensors and torch's own full state
dict (`get_model_state_dict`, the round trips' oracle, which catches a gather returning a wrong
shard), casting before gathering equals casting after; the session narrows only what every
reading group merely copies."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence

import pytest
import torch

from p2psync.core.layout import Layout, ParamGroup
from p2psync.trainer.compiler import narrower_dtypes
from p2psync.core.types import ParamSpec
from p2psync.worlds import free_port
from p2psync.worlds.processes import context, process

#: Uneven first dimensions over 2 ranks (torch.chunk leaves the last shard shorter), 1-D to 3-D.
SHAPES = [(5,), (7, 3), (1, 4), (4, 4, 2), (3,)]


def _rank(rank: int, port: int, failures: mp.Queue) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from p2psync.adapters.fsdp2 import FSDP2Source

    class WrongShard(FSDP2Source):
        """A gather whose dim-0 shards come back in the wrong order."""

        def gather_cast(self, names, dtypes):  # noqa: ANN001, ANN202
            return {n: t.roll(t.shape[0] // 2, 0) for n, t in super().gather_cast(names, dtypes).items()}

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
    for layer in model.layers:
        for j, shape in enumerate(SHAPES):
            layer.register_parameter(f"p{j}", torch.nn.Parameter(torch.randn(shape)))
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    source = FSDP2Source(model)
    got = source.gather(list(full))
    narrow = {n: "bfloat16" for n in list(full)[::2]}
    cast = source.gather_cast(list(full), narrow)
    bad = [n for n in full if not torch.equal(got[n], full[n])]
    bad += [f"{n} cast" for n in full if not torch.equal(cast[n], full[n].to(torch.bfloat16) if n in narrow else full[n])]
    oracle = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    bad += [f"{n} vs torch's state dict" for n in full if not torch.equal(got[n], oracle[n])]
    wrong = WrongShard(model).gather(list(full))
    missed = [n for n in full if full[n].shape[0] > 1 and torch.equal(wrong[n], oracle[n])]
    failures.put((rank, bad + [f"{n}: a wrong shard went unnoticed" for n in missed]))
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_gather_and_gather_cast_equal_the_full_tensors():
    ctx = context()
    failures = ctx.Queue()
    port = free_port()
    procs = [process(ctx, _rank, (r, port, failures)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(failures.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {0: [], 1: []}


class _Layout(Layout):
    def __init__(self, dtypes: dict[tuple[str, ...], str | None]) -> None:
        self.dtypes = dtypes

    def groups(self) -> Sequence[ParamGroup]:
        return [ParamGroup(inputs, inputs, 0) for inputs in self.dtypes]

    def fill(self, group, tensors, out):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def copy_dtype(self, group: ParamGroup) -> str | None:
        return self.dtypes[group.inputs]


def test_gather_narrows_only_what_every_reading_group_copies_into_one_narrower_dtype():
    specs = {n: ParamSpec(n, (4,), "float32") for n in "abcdef"}
    specs["f"] = ParamSpec("f", (4,), "bfloat16")
    one = _Layout({("a",): "bfloat16", ("b", "c"): "bfloat16", ("d",): "bfloat16", ("e",): None, ("f",): "bfloat16"})
    other = _Layout({("a",): "bfloat16", ("c",): "float16", ("d",): None, ("e",): "bfloat16"})
    reads = [(layout, g) for layout in (one, other) for g in layout.groups()]

    # a, b: copies into bfloat16 everywhere; c: two dtypes; d, e: computed somewhere; f: not narrower
    assert narrower_dtypes(specs, reads) == {"a": "bfloat16", "b": "bfloat16"}
