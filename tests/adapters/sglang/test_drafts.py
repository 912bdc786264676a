"""Speculative drafts on sglang: a rank that runs its checkpoint's MTP (NextN) draft publishes the
draft's parameters beside its own (`shim.TargetAndDraft`), so one layout writes both, one update
does it in one pause, and the digest check covers both. Environment: conformance-sglang."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e conformance-sglang`")
pytest.importorskip("transformers", reason="transformers is not installed")

import os  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from tests.helpers.model_configs import checkpoint, hf_config  # noqa: E402
from tests.helpers.sglang_models import config_dict, produce, specs, table_of  # noqa: E402

from p2psync.adapters.sglang.target import SglangEngineTarget  # noqa: E402

#: The draft's own HF tensors at layer N that sglang copies unchanged (replicated on every rank).
MTP_COPIES = {"eh_proj.weight": "eh_proj", "enorm.weight": "enorm", "hnorm.weight": "hnorm",
              "shared_head.norm.weight": "shared_head.norm"}
CASES = [("deepseek_v3", 2, 1), ("glm4_moe", 2, 2)]


def draft_rank(kind: str, tp: int, ep: int, rank: int, tensors: dict[str, torch.Tensor]):
    """sglang's model of `rank` with its MTP draft, parameters prefilled with 0xA5 bytes, after
    sglang's own loads (the target's, then the draft worker's) of copies of `tensors`; and the
    table that rank publishes with its draft."""
    from p2psync.adapters.sglang.key import layout_key
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model, hf_config_dict, require_sglang

    rank_model = build_rank_model(RankSpec(config_dict(hf_config(kind)), tp, ep, "bfloat16", rank, draft=True), "cpu")
    for p in rank_model.model.parameters():
        p.data.view(torch.uint8).fill_(0xA5)
    rank_model.load([(name, t.clone()) for name, t in tensors.items()])
    config = rank_model.model_config
    key = layout_key(rank_model.server_args, hf_config_dict(config), str(config.dtype), require_sglang(),
                     draft_published=True)
    return rank_model, table_of(rank_model.model, key, rank)


@pytest.mark.parametrize("kind,tp,ep", CASES, ids=[f"{k}-tp{t}-ep{e}" for k, t, e in CASES])
def test_target_and_draft_bytes_equal_sglangs_loads_on_every_rank(kind, tp, ep):
    tensors = checkpoint(kind)
    mtp = f"model.layers.{hf_config(kind).num_hidden_layers}."
    for rank in range(tp):
        engine, table = draft_rank(kind, tp, ep, rank, tensors)
        held = produce(SglangEngineTarget().layout(table, specs(tensors)), tensors, table)
        expected = dict(engine.model.named_parameters())
        for name, tensor in expected.items():
            assert torch.equal(held[name], tensor.data.contiguous().view(-1).view(torch.uint8)), (kind, rank, name)
        published = {p.name for p in table.params}
        assert any(n.startswith("draft.model.decoder.") for n in published)
        # the draft's embedding and head are the target's storage: published, written and checked once
        draft = engine.model.draft
        assert draft.model.embed_tokens.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
        assert draft.lm_head.weight.data_ptr() == engine.model.lm_head.weight.data_ptr()
        assert not {"draft.model.embed_tokens.weight", "draft.lm_head.weight"} & published
        for hf, module in MTP_COPIES.items():  # sglang-independent: the draft's own layer N tensors
            want = tensors[mtp + hf].to(torch.bfloat16).view(-1).view(torch.uint8)
            assert torch.equal(held[f"draft.model.{module}.weight"], want), (kind, rank, hf)


def test_post_load_on_layout_bytes_derives_the_drafts_mla_weights():
    """The DeepSeek draft's MLA layer derives `w_kc`/`w_vc` after loading, as the target's do: the
    endpoint's post-load step on the layout's bytes makes both as sglang's own loads do."""
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model, post_load

    tensors = checkpoint("deepseek_v3")
    reference, table = draft_rank("deepseek_v3", 2, 1, 1, tensors)
    engine = build_rank_model(RankSpec(config_dict(hf_config("deepseek_v3")), 2, 1, "bfloat16", 1, draft=True), "cpu")
    for name, data in produce(SglangEngineTarget().layout(table, specs(tensors)), tensors, table).items():
        engine.model.get_parameter(name).data.view(-1).view(torch.uint8).copy_(data)
    post_load(engine.model)
    pairs = [(engine.model.draft.model.decoder, reference.model.draft.model.decoder)]
    pairs += list(zip(engine.model.model.layers, reference.model.model.layers))
    for got, want in pairs:
        assert torch.equal(got.self_attn.w_kc, want.self_attn.w_kc)
        assert torch.equal(got.self_attn.w_vc, want.self_attn.w_vc)


# -- one round trip: 2 FSDP2 trainer ranks -> one sglang engine of TP 2 running a DeepSeek-V3 MTP draft --

TP = 2
ENGINE = "mtp-0"


def trainer_model() -> torch.nn.Module:
    """The trainer's weights: the DeepSeek-V3 checkpoint's tensors with its MTP layer, each a parameter
    named after its HF name ('.' as '__': torch forbids dots in a parameter's name), as an
    MTP-training trainer exports them (experts one by one)."""
    model = torch.nn.Module()
    for name, tensor in checkpoint("deepseek_v3").items():
        model.register_parameter(name.replace(".", "__"), torch.nn.Parameter(tensor.clone()))
    return model


@dataclass(frozen=True)
class DraftRun:
    """What the draft round trip runs: 2 FSDP2 trainer ranks, one sglang engine of TP ranks."""

    dump_dir: str
    trainers: int = 2
    engines: int = TP
    updates: int = 2
    transport: str = "mooncake"
    bucket_bytes: int = 64 << 10
    transfer_timeout: float = 60.0
    job_id: str = field(default_factory=lambda: f"drafts-{os.getpid()}-{int(time.time())}")


def engine_process(index: int, opts: Any, port: int, stop: Any) -> None:
    """Rank `index` of the engine: sglang's model and MTP draft on CPU (0xA5-filled), served with the
    draft; on stop, dumps every parameter and the derived MLA weights of target and draft."""
    from p2psync.adapters.sglang import serve
    from p2psync.adapters.sglang.shim import RankSpec, build_rank_model
    from p2psync.core.logs import configure
    from p2psync.core.rendezvous import Rendezvous

    configure(f"{ENGINE} rank {index}")
    torch.set_num_threads(1)
    spec = RankSpec(config_dict(hf_config("deepseek_v3")), TP, 1, "bfloat16", index, draft=True)
    rank_model = build_rank_model(spec, "cpu")
    for p in rank_model.model.parameters():
        p.data.view(torch.uint8).fill_(0xA5)
    both = rank_model.model
    endpoint = serve(
        both.target, rank_model.server_args, rank_model.model_config, draft=both.draft, engine_id=ENGINE, rank=index,
        rendezvous=Rendezvous(host="127.0.0.1", port=port, job_id=opts.job_id), transport=opts.transport,
    )
    stop.wait()
    torch.save({"params": {n: p.data.clone() for n, p in both.named_parameters()}, "derived": derived(both)},
               Path(opts.dump_dir) / f"rank{index}.pt")
    endpoint.close()


def derived(both: Any) -> dict[str, torch.Tensor]:
    """The MLA weights sglang derives after loading, of every layer of target and draft."""
    layers = {f"layer{i}": layer for i, layer in enumerate(both.model.layers)} | {"draft": both.draft.model.decoder}
    return {f"{name}.{w}": getattr(layer.self_attn, w).clone() for name, layer in layers.items() for w in ("w_kc", "w_vc")}


def trainer_process(rank: int, opts: Any, port: int, results: Any) -> None:
    """An FSDP2 trainer rank: `opts.updates` times, change every weight and update the engine."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from p2psync.adapters.fsdp2 import FSDP2Source
    from p2psync.trainer.session import Session
    from p2psync.worlds import join_trainer_world

    model = trainer_model()
    rendezvous = join_trainer_world(rank, opts, port)
    fully_shard(model)
    rendezvous.read_engine(ENGINE, timeout=600)  # building sglang's ranks takes longer than connect waits
    source = FSDP2Source(model, name_map=lambda name: name.replace("__", "."))
    session = Session(source=source, transport=opts.transport, rendezvous=rendezvous,
                      bucket_bytes=opts.bucket_bytes, transfer_timeout=opts.transfer_timeout, check=True)
    session.connect([ENGINE])
    generator = torch.Generator().manual_seed(rank)
    reports = []
    for step in range(opts.updates):
        with torch.no_grad():  # a training step's stand-in: every shard changes
            for p in model.parameters():
                local = p.to_local()
                local.add_(torch.randn(local.shape, generator=generator) * 0.01)
        reports.append(session.update(f"step-{step + 1}"))
    final = {n: t.clone() for n, t in session.source.gather([s.name for s in session.source.param_specs()]).items()}
    if rank == 0:
        torch.save(final, Path(opts.dump_dir) / "trainer.pt")
    free, gathered = session.stats().gather_free_bytes  # known while connected
    session.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put({"reports": reports, "gather_free_bytes": free})


@pytest.mark.slow
@pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport="mooncake", via="MTP draft")
def test_an_update_writes_target_and_draft_as_sglangs_loads_make_them(tmp_path):
    pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")
    from p2psync.worlds import launch

    opts = DraftRun(dump_dir=str(tmp_path))
    result = launch(opts, engine_process, trainer_process)
    assert result["gather_free_bytes"] > 0  # the default session: each rank writes its own rows of target and draft
    for report in result["reports"]:  # one pause per update; the digests of target and draft checked
        assert report.ok and report.engines[ENGINE].checked and report.engines[ENGINE].bytes > 0, report.format()
    trained = torch.load(tmp_path / "trainer.pt")
    for rank in range(TP):
        reference, table = draft_rank("deepseek_v3", TP, 1, rank, trained)
        assert any(p.name.startswith("draft.") for p in table.params)
        held = torch.load(tmp_path / f"rank{rank}.pt")
        for name, tensor in reference.model.named_parameters():
            assert torch.equal(held["params"][name], tensor.data), (rank, name)
        for name, tensor in derived(reference.model).items():  # the endpoint's post-load step ran on both
            assert torch.equal(held["derived"][name], tensor), (rank, name)
