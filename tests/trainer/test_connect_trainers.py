"""Connect refusals that need several trainer ranks (environment py): ranks that disagree on an
HF tensor, and a parameter whose HF tensors are split across sender groups. Each is refused on
every rank with an error naming what disagrees (engine, rank, parameter), before any peer is
opened: the engine holds the same bytes, unpaused, at no version."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")
pytest.importorskip("transformers", reason="the engine is a transformers model")


from p2psync.adapters.torch.target import TorchEngineTarget  # noqa: E402
from p2psync.worlds import WorldOptions, join_trainer_world, launch  # noqa: E402
from p2psync.worlds.engines import engine_main  # noqa: E402
from p2psync.engine.endpoint import EndpointControl  # noqa: E402
from p2psync.core.errors import ConnectError  # noqa: E402
from p2psync.core.layout import Layout, ParamGroup  # noqa: E402
from p2psync.core.plugins import Registry  # noqa: E402
from p2psync.trainer.session import Session  # noqa: E402
from p2psync.core.source import TrainerSource  # noqa: E402
from p2psync.core.types import ParamSpec, Region, SenderGroup, TargetTable  # noqa: E402
from tests.helpers.doubles import CountingTransport, DictSource  # noqa: E402

Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"


class FusedQK(Layout):
    """The torch engine's layout with layer 0's q and k projections in one group, as engines that
    fuse them (sglang's and vLLM's qkv_proj) read them; only its groups matter here."""

    def __init__(self, inner: Layout) -> None:
        self.inner = inner

    def groups(self) -> Sequence[ParamGroup]:
        rest = [g for g in self.inner.groups() if g.inputs[0] not in (Q, K)]
        fused = [g for g in self.inner.groups() if g.inputs[0] in (Q, K)]
        return [ParamGroup((Q, K), (Q, K), sum(g.nbytes for g in fused)), *rest]

    def fill(self, group: ParamGroup, tensors: Mapping[str, Any], out: Any) -> list[Region]:
        raise AssertionError("connect must refuse before anything is filled")


class FusingTorchTarget(TorchEngineTarget):
    def layout(self, table: TargetTable, sources: Mapping[str, ParamSpec]) -> Layout:
        return FusedQK(super().layout(table, sources))


def attempt(source: TrainerSource, rendezvous: Any, registry: Registry | None = None) -> tuple[str, int]:
    """Connect to engine-0; the refusal's message and how many peers were opened."""
    transport = CountingTransport()
    with Session(source=source, transport=transport, rendezvous=rendezvous, registry=registry) as session:
        try:
            session.connect(["engine-0"])
        except ConnectError as exc:
            return str(exc), len(transport.opened)
    return "", len(transport.opened)


def engine_state(rendezvous: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """Digests of every parameter engine-0 holds, and its version and pause state."""
    (table,) = rendezvous.read_engine("engine-0")
    control = EndpointControl([table], timeout=30, token=rendezvous.token())
    regions = {p.name: [Region(p.name, 0, 0, p.nbytes)] for p in table.params}
    return control.digests(0, regions), control.info(0)


def trainer(rank: int, opts: WorldOptions, port: int, results: Any) -> None:
    import torch.distributed as dist

    full = opts.model.build(seed=0).state_dict()
    rendezvous = join_trainer_world(rank, opts, port, timeout=300)
    before = engine_state(rendezvous) if rank == 0 else None

    differing = dict(full)
    if rank == 1:
        differing["lm_head.weight"] = differing["lm_head.weight"][:-1]
    disagree = attempt(DictSource(differing, SenderGroup("all", (0, 1), rank)), rendezvous)

    registry = Registry()
    registry.add("engine_targets", FusingTorchTarget, "test", "0")
    mine = {n: t for n, t in full.items() if (n == K) == (rank == 1)}  # rank 1 holds k, rank 0 the rest
    split = attempt(DictSource(mine, SenderGroup(f"stage{rank}", (rank,), rank)), rendezvous, registry)

    outcomes: list[Any] = [None, None]
    dist.all_gather_object(outcomes, {"disagree": disagree, "split": split})
    if rank == 0:
        results.put({"ranks": outcomes, "before": before, "after": engine_state(rendezvous)})
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def refusals() -> dict[str, Any]:
    opts = WorldOptions(engine="torch", engines=1, runs=(("fsdp2", "mooncake"),))
    return launch(opts, engine_main, trainer)


@pytest.mark.slow
def test_trainer_ranks_that_disagree_on_a_tensor_are_refused_naming_both_ranks(refusals):
    for rank, outcome in enumerate(refusals["ranks"]):
        message, opened = outcome["disagree"]
        assert "trainer ranks 0 and 1 disagree on HF tensor 'lm_head.weight'" in message, (rank, message)
        assert "(300, 64)" in message and "(299, 64)" in message, message
        assert opened == 0, f"rank {rank} opened {opened} peers"


@pytest.mark.slow
def test_a_parameter_whose_tensors_are_split_across_sender_groups_is_refused(refusals):
    for rank, outcome in enumerate(refusals["ranks"]):
        message, opened = outcome["split"]
        assert (
            f"engine 'engine-0' rank 0 parameter '{Q}' needs HF tensors ['{Q}', '{K}'], which are split across "
            "sender groups"
        ) in message, (rank, message)
        assert opened == 0, f"rank {rank} opened {opened} peers"


@pytest.mark.slow
def test_nothing_was_written_nor_paused(refusals):
    digests, info = refusals["after"]
    assert digests == refusals["before"][0]
    assert (info["rank"], info["version"], info["updating"], info["stale"]) == (0, None, None, None)  # never paused
