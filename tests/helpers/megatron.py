"""Megatron source checks in gloo worlds: tiny Megatron-Core models whose weights are a
transformers model's (written into this rank's shards by `load_hf`), the source's HF
tensors compared with the transformers checkpoint, and Megatron's logits with transformers'.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from p2psync.worlds import TINY_QWEN3, ModelSpec, free_port
from p2psync.worlds.megatron import (
    Case,
    bridge_adapter_export,
    bridge_deepseek_registry,
    bridge_lora,
    bridge_mapping_modules,
    load_hf,
    logits_differ,
    megatron_model,
)
from p2psync.worlds.processes import context, process

HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    ),
    "qwen3": TINY_QWEN3,
    "qwen3_moe": dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
    ),
    "deepseek_v3": dict(  # MLA; layer 0 dense, layer 1 MoE with a shared expert
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, tie_word_embeddings=False,
    ),
}

#: Other layouts of an architecture: HF config changes, by name.
VARIANTS: dict[str, dict[str, Any]] = {
    "q_proj": dict(q_lora_rank=None),  # MLA without the query LoRA: one `q_proj`
    "dense": dict(first_k_dense_replace=2),  # no MoE layer: Bridge maps only Transformer Engine's expert names
}


def hf_config(arch: str, variant: str = "") -> dict[str, Any]:
    """The tiny HF config of `arch`, changed as `variant` says."""
    return {**HF_CONFIGS[arch], **(VARIANTS[variant] if variant else {})}


def hf_model(arch: str, seed: int, variant: str = "") -> Any:
    """A randomly initialized transformers causal LM of `arch` (no download)."""
    return ModelSpec(arch, hf_config(arch, variant)).build(seed)


def checkpoint(model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors as its HF checkpoint names them (transformers 5 fuses experts in
    memory; `save_pretrained` writes one tensor per expert)."""
    import glob
    import tempfile

    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        for f in sorted(glob.glob(f"{d}/*.safetensors")):
            out.update(load_file(f))
    return out


def init_world(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def check_source(case: Case, hf: dict[str, torch.Tensor]) -> list[str]:
    """Build `case` on this rank and compare what the source yields with the HF checkpoint tensors `hf`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from p2psync.adapters.megatron import MegatronSource

    model = megatron_model(case, hf_config(case.arch, case.variant))
    load_hf(model, hf, case.arch)
    source = MegatronSource(model, case.arch)
    errors = compare(source, hf)
    names = [s.name for s in source.param_specs()]
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, (ps.get_pipeline_model_parallel_rank(), names))
    if set().union(*(set(n) for _, n in stages)) != set(hf):
        errors.append("the stages together do not yield every HF tensor")
    group = source.sender_group()
    stage = ps.get_pipeline_model_parallel_rank()
    if group.group_id != f"pp{stage}" or group.ranks != tuple(r for r, (s, _) in enumerate(stages) if s == stage):
        errors.append(f"sender group {group} is not the ranks of stage {stage}")
    return [f"rank {dist.get_rank()}: {e}" for e in errors]


def compare(source: Any, hf: dict[str, torch.Tensor]) -> list[str]:
    """How the specs and tensors of `source` differ from the HF checkpoint tensors `hf`."""
    errors = []
    specs = source.param_specs()
    for spec in specs:
        want = hf.get(spec.name)
        if want is None or spec.shape != tuple(want.shape) or spec.dtype != str(want.dtype).removeprefix("torch."):
            errors.append(f"spec {spec} does not match the HF tensor")
    names = [s.name for s in specs]
    for i in range(0, len(names), 5):  # bucket-sized pieces: q/k/v and gate/up get split apart
        for name, tensor in source.gather(names[i : i + 5]).items():
            if not torch.equal(tensor, hf[name]):
                errors.append(f"{name}: gathered tensor differs from the HF tensor")
    return errors


def check_local_shards(case: Case, hf: dict[str, torch.Tensor]) -> list[str]:
    """Build `case` on this rank and check MegatronSource's local shards (`shard_errors`)."""
    import torch.distributed as dist

    from p2psync.adapters.megatron import MegatronSource

    model = megatron_model(case, hf_config(case.arch, case.variant))
    load_hf(model, hf, case.arch)
    vocab = hf["model.embed_tokens.weight"].shape[0]
    source = MegatronSource(model, case.arch, vocab_size=vocab if case.vocab_pad else None)
    return [f"rank {dist.get_rank()}: {e}" for e in shard_errors(source, hf)]


def shard_errors(source: Any, hf: dict[str, torch.Tensor]) -> list[str]:
    """The local shards of every rank of the sender group of `source`, placed by their ranges into
    zeros, must give what its gather gives, and the HF checkpoint tensors `hf`; their ranges must
    cover every element exactly once; and every HF tensor must be described (none left to the
    gather). Collective over the world."""
    import torch.distributed as dist

    specs = source.param_specs()
    shards = source.local_shards([s.name for s in specs])
    errors = [f"{s.name}: not described (left to the gather)" for s in specs if s.name not in shards]
    mine = {name: (shard.ranges, shard.data.clone()) for name, shard in shards.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    names = [s.name for s in specs]
    gathered = {n: t for i in range(0, len(names), 5) for n, t in source.gather(names[i : i + 5]).items()}
    for spec in specs:
        placed = torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype)).view(-1)
        held = torch.zeros(placed.numel(), dtype=torch.int64)
        for rank in source.sender_group().ranks:
            ranges, data = everyone[rank].get(spec.name, ((), None))
            offset = 0
            for start, end in ranges:
                placed[start:end] = data[offset : offset + end - start]
                held[start:end] += 1
                offset += end - start
            if data is not None and offset != data.numel():
                errors.append(f"{spec.name}: rank {rank}'s data has {data.numel()} elements, its ranges {offset}")
        if not bool((held == 1).all()):
            errors.append(f"{spec.name}: elements held {sorted(set(held.tolist()))} times across the sender group")
        if not torch.equal(placed.view(spec.shape), gathered[spec.name]):
            errors.append(f"{spec.name}: the placed local shards differ from the gathered tensor")
        if not torch.equal(placed.view(spec.shape), hf[spec.name]):
            errors.append(f"{spec.name}: the placed local shards differ from the HF tensor")
    return errors


def check_forward(case: Case, hf: dict[str, torch.Tensor]) -> list[str]:
    """Megatron's logits with the weights placed by the name table equal transformers' (to float
    rounding): the table is right in meaning, not only consistent with `load_hf`, its inverse.
    One rank, no model parallelism."""
    model = megatron_model(case, hf_config(case.arch, case.variant))
    load_hf(model, hf, case.arch)
    reference = hf_model(case.arch, seed=7, variant=case.variant)  # the model `hf` was saved from
    return [error] if (error := logits_differ(model, reference)) else []


def bridge_qwen3_registry() -> Any:
    """Megatron-Bridge's own mappings as its Qwen3 bridge composes them (`qwen/qwen3_bridge.py`:
    `QKVMapping`, `GatedMLPMapping`, `AutoMapping`s), with the local spec's names for the norms
    that Transformer Engine's spec fuses into the linears (that bridge names only those, and
    importing it imports Transformer Engine)."""
    bridge_mapping_modules()
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping, QKVMapping

    layer, hf = "decoder.layers.*.", "model.layers.*."
    auto = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "output_layer.weight": "lm_head.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        layer + "input_layernorm.weight": hf + "input_layernorm.weight",
        layer + "pre_mlp_layernorm.weight": hf + "post_attention_layernorm.weight",
        layer + "self_attention.q_layernorm.weight": hf + "self_attn.q_norm.weight",
        layer + "self_attention.k_layernorm.weight": hf + "self_attn.k_norm.weight",
        layer + "self_attention.linear_proj.weight": hf + "self_attn.o_proj.weight",
        layer + "mlp.linear_fc2.weight": hf + "mlp.down_proj.weight",
    }
    return MegatronMappingRegistry(
        *(AutoMapping(megatron_param=m, hf_param=h) for m, h in auto.items()),
        QKVMapping(layer + "self_attention.linear_qkv.weight", *(f"{hf}self_attn.{p}_proj.weight" for p in "qkv")),
        GatedMLPMapping(layer + "mlp.linear_fc1.weight", hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
    )


#: Per architecture, the Megatron-Bridge mapping registry its Bridge checks convert with.
BRIDGE_REGISTRIES: dict[str, Callable[[], Any]] = {
    "deepseek_v3": bridge_deepseek_registry,
    "qwen3": bridge_qwen3_registry,
}


def check_bridge(case: Case, hf: dict[str, torch.Tensor]) -> list[str]:
    """Build `case` on this rank and compare what BridgeSource yields through Megatron-Bridge's
    own mappings (`BRIDGE_REGISTRIES`) with the HF checkpoint tensors `hf`: gathered, and as
    local shards (`shard_errors`)."""
    import torch.distributed as dist

    from p2psync.adapters.megatron.bridge import BridgeSource

    model = megatron_model(case, hf_config(case.arch, case.variant))
    load_hf(model, hf, case.arch)
    source = BridgeSource(model, BRIDGE_REGISTRIES[case.arch]())  # after the parallel state: mappings take its groups
    errors = compare(source, hf)
    if {s.name for s in source.param_specs()} != set(hf):
        errors.append("the source does not yield every HF tensor on every rank")
    errors += shard_errors(source, hf)
    return [f"rank {dist.get_rank()}: {e}" for e in errors]


#: The PEFT settings of the adapter `check_bridge_lora` puts on every model (Bridge's default targets).
BRIDGE_LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                           "up_proj", "v_proj"], "use_rslora": False, "use_dora": False}


def check_bridge_lora(case: Case, hf: dict[str, torch.Tensor]) -> list[str]:
    """Build `case`, apply Megatron-Bridge's own LoRA to it (`bridge_lora`), and compare what
    BridgeLoraSource yields, gathered and as local shards (`shard_errors`), with Bridge's own
    adapter export (`bridge_adapter_export`, PEFT's prefix added), and its settings with the
    adapters Bridge made."""
    import torch.distributed as dist

    from p2psync.adapters.megatron.lora import PEFT_PREFIX, BridgeLoraSource

    model = megatron_model(case, hf_config(case.arch, case.variant))
    load_hf(model, hf, case.arch)
    model = bridge_lora(model, dim=BRIDGE_LORA["r"], alpha=BRIDGE_LORA["lora_alpha"], seed=5)
    exported = {PEFT_PREFIX + n: t for n, t in bridge_adapter_export(model, BRIDGE_REGISTRIES[case.arch]()).items()}
    source = BridgeLoraSource(model, case.arch)
    errors = compare(source, exported) + shard_errors(source, exported)
    stages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(stages, [s.name for s in source.param_specs()])
    if set().union(*map(set, stages)) != set(exported):
        errors.append(f"the stages together yield {sorted(set().union(*map(set, stages)) ^ set(exported))[:4]} "
                      f"apart from Bridge's export")
    if source.config != BRIDGE_LORA:
        errors.append(f"settings {source.config} are not the adapters' {BRIDGE_LORA}")
    return [f"rank {dist.get_rank()}: {e}" for e in errors]


def source_worker(rank: int, world: int, port: int, cases: list[Case], results: Any,
                  check: Callable[[Case, dict[str, torch.Tensor]], list[str]] = check_source) -> None:
    """Run `check` on every case in one gloo world; rank 0 reports each case's errors."""
    import torch.distributed as dist

    # transformers saves differently once torch.distributed is up: save before joining the world
    tensors = {(a, v): checkpoint(hf_model(a, seed=7, variant=v)) for a, v in {(c.arch, c.variant) for c in cases}}
    init_world(rank, world, port)
    outcome = {}
    for case in cases:
        try:
            errors = check(case, tensors[case.arch, case.variant])
        except Exception as exc:  # reported per case, the world goes on to the next
            errors = [f"rank {rank}: {type(exc).__name__}: {exc}"]
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, errors)
        outcome[case.id] = [e for es in everyone for e in es]
    if rank == 0:
        results.put(outcome)
    dist.destroy_process_group()


def run_world(world: int, cases: list[Case], check: Callable[[Case, dict[str, torch.Tensor]], list[str]]
              = check_source) -> dict[str, list[str]]:
    """Each case's errors from `check`, run in one gloo world of `world` fresh processes (torch and
    megatron import once per process)."""
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    procs = [process(ctx, source_worker, (r, world, port, cases, results, check)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=240)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
