"""Delta updates through the shared layout room (tox env py): the toy engine of
test_add_an_engine (fused tensor-parallel qkv, columns of o, a padded vocabulary split by
rows, a tied head, norms its own loader computes as 1 + w) at TP 2, served in this
process over samehost. After every delta update each rank must hold exactly what its own
`load_weights` makes of the trainer's tensors: the regions a copy map writes (parts of a
parameter, at offsets), the loader's own parameters and the untouched padding alike."""

from __future__ import annotations

import torch
from test_add_an_engine import ToyRankModel, ToyTarget, engine_rank, hf_model, serve_toy

from p2psync.adapters.fsdp2 import FSDP2Source
from p2psync.core.plugins import registry
from p2psync.core.rendezvous import Rendezvous
from p2psync.core.session import Session


def own_load(tp: int, rank: int, trainer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the engine's own loader leaves in 0xA5-filled memory (the engines start so)."""
    model = ToyRankModel(tp, rank, "cpu").model
    for p in model.parameters():
        p.data.view(torch.uint8).fill_(0xA5)
    model.load_weights([(n, t.detach().clone()) for n, t in trainer.state_dict().items()])
    return {n: p.data for n, p in model.named_parameters()}


def touch_a_few(trainer: torch.nn.Module, step: int) -> None:
    """Change about 1% of every tensor's elements, as a small optimizer step does to bf16 bytes."""
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in trainer.parameters():
            pick = torch.rand(p.shape, generator=generator) < 0.01
            p[pick] += 0.5


def test_delta_updates_toy_engines_bit_exact_with_their_own_loader():
    registry().add("engine_targets", ToyTarget, "tests", "0")
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="toy-delta", is_server=True, timeout=10)
    trainer = hf_model(1)
    sources = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
    engines = [engine_rank(2, r, sources)[0] for r in range(2)]
    endpoints = [serve_toy(engine, engine_id="toy-0", rendezvous=rendezvous, transport="samehost") for engine in engines]
    try:
        with Session(
            source=FSDP2Source(trainer), transport="samehost", rendezvous=rendezvous, check=True, delta=True,
            bucket_bytes=4096,
        ) as session:
            session.connect(["toy-0"])
            full_bytes = None
            for step in range(4):
                if step:
                    touch_a_few(trainer, step)
                report = session.update(f"v{step}")
                assert report.ok, report.format()
                assert report.engines["toy-0"].delta_ranks == ([0, 1] if step else [])
                if step == 0:
                    full_bytes = report.engines["toy-0"].bytes
                else:
                    assert report.engines["toy-0"].bytes < full_bytes / 2, report.format()
                for rank, engine in enumerate(engines):
                    expected = own_load(2, rank, trainer)
                    for name, p in engine.named_parameters():
                        assert torch.equal(p.data.view(torch.uint8), expected[name].view(torch.uint8)), (step, name)
    finally:
        for endpoint in endpoints:
            endpoint.close()
        del registry().entries["engine_targets"]["toy"]
