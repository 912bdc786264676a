"""Delta updates into sglang's own model ranks (tox env conformance-sglang): both TP ranks of
a tiny Qwen3 in bfloat16, sglang's model built on CPU and served by p2psync's sglang endpoint
in this process over samehost. After every update, full or delta, each rank must hold exactly
what sglang's own `load_weights` makes of the trainer's tensors on that rank."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang", reason="sglang is not installed (tox env conformance-sglang)")

import torch  # noqa: E402
import transformers  # noqa: E402

from p2psync.adapters.fsdp2 import FSDP2Source  # noqa: E402
from p2psync.adapters.sglang import serve  # noqa: E402
from p2psync.adapters.sglang.shim import RankSpec, build_rank_model  # noqa: E402
from p2psync.worlds.oracles import SGLANG_FILL  # noqa: E402
from p2psync.core.rendezvous import Rendezvous  # noqa: E402
from p2psync.trainer.session import Session  # noqa: E402

TP = 2


def own_load(config: dict, rank: int, trainer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What sglang's own loader leaves on `rank` (its memory prefilled as the served ranks')."""
    model = build_rank_model(RankSpec(config, TP, 1, "bfloat16", rank), "cpu")
    for p in model.model.parameters():
        p.data.view(-1).view(torch.uint8).fill_(SGLANG_FILL)
    model.load([(n, t.detach().clone()) for n, t in trainer.state_dict().items()])
    return {n: p.data for n, p in model.model.named_parameters()}


def test_delta_updates_leave_sglang_ranks_as_their_own_loader_does():
    hf = transformers.Qwen3Config(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"],
    )
    config = json.loads(hf.to_json_string(use_diff=False))
    torch.manual_seed(0)
    trainer = transformers.Qwen3ForCausalLM(hf)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    ranks = [build_rank_model(RankSpec(config, TP, 1, "bfloat16", r), "cpu") for r in range(TP)]
    for m in ranks:
        for p in m.model.parameters():
            p.data.view(-1).view(torch.uint8).fill_(SGLANG_FILL)
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="sglang-delta", is_server=True, timeout=30)
    endpoints = [
        serve(m.model, m.server_args, m.model_config, engine_id="s", rank=r, rendezvous=rendezvous,
              transport="samehost")
        for r, m in enumerate(ranks)
    ]
    generator = torch.Generator().manual_seed(0)
    try:
        with Session(
            source=FSDP2Source(trainer), transport="samehost", rendezvous=rendezvous, check=True, delta=True,
            bucket_bytes=64 << 10,
        ) as session:
            session.connect(["s"])
            for step in range(4):
                if step:  # a real AdamW step on random tokens
                    tokens = torch.randint(0, hf.vocab_size, (2, 8), generator=generator)
                    trainer(input_ids=tokens, labels=tokens).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                report = session.update(f"v{step}")
                assert report.ok, report.format()
                assert report.engines["s"].delta_ranks == ([0, 1] if step else []), report.format()
                assert 0 < report.changed_fraction < 1 or step == 0, report.format()
                for r, m in enumerate(ranks):
                    expected = own_load(config, r, trainer)
                    for name, p in m.model.named_parameters():
                        assert torch.equal(p.data.view(torch.uint8), expected[name].view(torch.uint8)), (step, r, name)
    finally:
        for endpoint in endpoints:
            endpoint.close()
