"""Tiny Megatron-Core GPT models on CPU (gloo) whose weights are a transformers model's.

The HF model is built from a seed in every process; its tensors are written into
the Megatron shards of this rank by hand (the inverse of what the source does), so
that the source's output can be compared with the HF state dict bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import chain
from typing import Any, TypeVar

import torch

from p2psync.demo import CONFIGS

J = TypeVar("J")

HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    ),
    "qwen3": CONFIGS["tiny"],  # the demo's model: what the torch and sglang test engines build
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


@dataclass(frozen=True)
class Case:
    """One parallel layout of one architecture."""

    arch: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    variant: str = ""  # a key of VARIANTS

    @property
    def id(self) -> str:
        arch = f"{self.arch}-{self.variant}" if self.variant else self.arch
        return f"{arch}-tp{self.tp}-pp{self.pp}-ep{self.ep}-etp{self.etp}"


def hf_config(arch: str, variant: str = "") -> dict[str, Any]:
    """The tiny HF config of `arch`, changed as `variant` says."""
    return {**HF_CONFIGS[arch], **(VARIANTS[variant] if variant else {})}


def hf_model(arch: str, seed: int, variant: str = "") -> Any:
    """A randomly initialized transformers causal LM of `arch` (no download)."""
    import transformers

    cls = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{cls}Config")(**hf_config(arch, variant), max_position_embeddings=256,
                                                    initializer_range=0.05)
    config._attn_implementation = "eager"
    model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms start at 1 and the router's score bias at 0: make them tell layers apart
        for name, t in chain(model.named_parameters(), model.named_buffers()):
            if "norm" in name or name.endswith("e_score_correction_bias"):
                t.add_(torch.randn_like(t) * 0.1)
    return model


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


def hide_cuda_only_kernels() -> None:
    """Make `flash_mla` absent on a machine without CUDA.

    sglang's environment installs flash_mla, a CUDA-only kernel package: without a CUDA
    driver its import raises OSError, while Megatron's attention module imports it
    expecting only ImportError. On a CPU machine the kernel cannot run anyway."""
    import sys

    if not torch.cuda.is_available():
        sys.modules.setdefault("flash_mla", None)  # `import flash_mla` now raises ImportError


def megatron_model(case: Case, hf: Mapping[str, Any] | None = None) -> Any:
    """This rank's GPTModel of `case` (model parallel state initialized here), shaped as the HF
    config `hf` (default: `HF_CONFIGS[case.arch]`)."""
    hide_cuda_only_kernels()
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(case.tp, case.pp, expert_model_parallel_size=case.ep,
                                 expert_tensor_parallel_size=case.etp)
    hf = hf_config(case.arch, case.variant) if hf is None else hf
    experts = hf.get("num_experts") or hf.get("n_routed_experts")
    mla = case.arch == "deepseek_v3"
    config = (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]),
        ffn_hidden_size=hf["intermediate_size"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=case.arch == "qwen2", normalization="RMSNorm",
        qk_layernorm=case.arch != "qwen2", tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp, expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.etp, sequence_parallel=False, use_cpu_initialization=True,
        perform_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_dtype=torch.float32, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        **(dict(num_moe_experts=experts, moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_router_topk=hf["num_experts_per_tok"], moe_token_dispatcher_type="allgather",
                moe_grouped_gemm=False) if experts else {}),
        **(dict(q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
                qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], rope_type="rope",
                moe_layer_freq=[int(i >= hf["first_k_dense_replace"]) for i in range(hf["num_hidden_layers"])],
                moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf["n_shared_experts"],
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=hf["routed_scaling_factor"]) if mla else {}),
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    with mla_on_cpu(spec) if mla else nullcontext():
        return GPTModel(
            config, spec, vocab_size=hf["vocab_size"], max_sequence_length=256,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=False, position_embedding_type="rope",
        )


@contextmanager
def mla_on_cpu(spec: Any) -> Iterator[None]:
    """Let megatron-core 0.16.1 build its MLA layers (local spec) on a machine without CUDA and
    Transformer Engine. Unpatched it fails three ways, none about a parameter:
    - the local `DotProductAttention` does not take the `k_channels`/`v_channels` MLA passes (only
      TE's attention does): the spec gets a parameter-free subclass that accepts them;
    - MLA's `RotaryEmbedding` ignores `use_cpu_initialization` and asks `torch.cuda.current_device()`;
    - megatron-core mocks an absent TE, MLA's module believes TE present and calls
      `isinstance(linear_proj, TELinear)` with the mock: it is told TE's real state."""
    from unittest import mock

    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:  # Attention builds it without them first, MLA again with them
            super().__init__(*args, **kwargs)

    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = MLACoreAttention
    with mock.patch.object(mla, "HAVE_TE", te.HAVE_TE):
        if torch.cuda.is_available():
            yield
            return
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
            yield


def load_hf(model: Any, hf: dict[str, torch.Tensor], arch: str) -> None:
    """Write HF tensors into this rank's Megatron shards (the inverse of the source)."""
    from megatron.core import parallel_state as ps

    from p2psync.adapters.megatron.names import Split, canonical, table

    rules = table(arch)
    config = model.config
    local_experts = (config.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
    buffers = ((n, b) for n, b in model.named_buffers() if canonical(n).name in rules)  # a router's expert bias
    for name, param in chain(model.named_parameters(), buffers):
        canon = canonical(name)
        rule = rules[canon.name]
        layer = model.decoder.layers[canon.layer].layer_number - 1 if canon.layer is not None else None
        expert = None
        if canon.expert is not None:
            expert = ps.get_expert_model_parallel_rank() * local_experts + canon.expert
            rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        else:
            rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        parts = [hf[t.format(layer=layer, expert=expert)] for t in rule.hf]
        if not getattr(param, "tensor_model_parallel", False):
            rank, size = 0, 1
        dim = getattr(param, "partition_dim", 0)
        if rule.split is Split.GATE_UP:  # stride 2: each shard is [gate_r; up_r]
            shard = torch.cat([p.chunk(size, 0)[rank] for p in parts], 0)
        elif rule.split is Split.QKV:
            groups, head_dim = config.num_query_groups, config.kv_channels
            q, k, v = (p.reshape(groups, -1, head_dim, *p.shape[1:]) for p in parts)
            full = torch.cat([q, k, v], 1).reshape(-1, *parts[0].shape[1:])
            shard = full.chunk(size, 0)[rank]
        else:
            shard = parts[0].chunk(size, dim)[rank]
        with torch.no_grad():
            param.copy_(shard)


def check_source(case: Case, hf: dict[str, torch.Tensor]) -> list[str]:
    """Build `case` on this rank and compare what the source yields with the HF checkpoint tensors `hf`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from p2psync.adapters.megatron import MegatronSource

    model = megatron_model(case)
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


def check_forward(case: Case, hf: dict[str, torch.Tensor]) -> list[str]:
    """Megatron's logits with the weights placed by the name table equal transformers' (to float
    rounding): the table is right in meaning, not only consistent with `load_hf`, its inverse.
    One rank, no model parallelism."""
    model = megatron_model(case)
    load_hf(model, hf, case.arch)
    reference = hf_model(case.arch, seed=7, variant=case.variant)  # the model `hf` was saved from
    vocab = hf["model.embed_tokens.weight"].shape[0]
    ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(1))
    causal = torch.ones(1, 1, 12, 12, dtype=torch.bool).triu(1)  # True: masked
    with torch.no_grad(), forward_on_cpu():
        got = model.eval()(ids, torch.arange(12)[None], causal)
        want = reference(input_ids=ids).logits
    diff = (got - want).abs().max().item()
    return [] if diff < 1e-5 else [f"Megatron's logits differ from transformers' by up to {diff}"]


@contextmanager
def forward_on_cpu() -> Iterator[None]:
    """Megatron-Core 0.16.1's forward on CPU: it asks for the CUDA device, forks the CUDA RNG
    tracker (for dropout, here of probability 0), and its MoE router names `te_general_gemm`,
    which is unbound without Transformer Engine."""
    from unittest import mock

    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer.moe import moe_utils

    with (
        mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
        mock.patch.object(CudaRNGStatesTracker, "fork", lambda self, *args, **kwargs: nullcontext()),
        mock.patch.object(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), create=True),
    ):
        yield


def check_bridge(case: Case, hf: dict[str, torch.Tensor]) -> list[str]:
    """Build `case` (a DeepSeek-V3) on this rank and compare what BridgeSource yields through
    Megatron-Bridge's own DeepSeek mappings with the HF checkpoint tensors `hf`."""
    import torch.distributed as dist

    from p2psync.adapters.megatron.bridge import BridgeSource

    model = megatron_model(case)
    load_hf(model, hf, case.arch)
    source = BridgeSource(model, bridge_deepseek_registry())  # after the parallel state: mappings take its groups
    errors = compare(source, hf)
    if {s.name for s in source.param_specs()} != set(hf):
        errors.append("the source does not yield every HF tensor on every rank")
    return [f"rank {dist.get_rank()}: {e}" for e in errors]


def bridge_deepseek_registry() -> Any:
    """Megatron-Bridge's own DeepSeek mapping registry (`deepseek/common.py`, the one that needs no
    model bridge class). Bridge's package imports Transformer Engine (`peft/lora_layers.py`) though
    its mappings do not: where TE does not import, Bridge's mapping modules are loaded without the
    package `__init__`s."""
    import importlib.util
    import sys
    import types

    try:
        import megatron.bridge  # noqa: F401
    except ImportError:
        spec = importlib.util.find_spec("megatron.bridge")
        assert spec is not None and spec.submodule_search_locations, "megatron-bridge is not installed"
        root = spec.submodule_search_locations[0]
        for package in ("", ".models", ".models.conversion", ".models.deepseek"):
            module = types.ModuleType(f"megatron.bridge{package}")
            module.__path__ = [root + package.replace(".", "/")]
            sys.modules[module.__name__] = module
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.deepseek.common import get_common_mapping_list

    return MegatronMappingRegistry(*get_common_mapping_list())


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
    import multiprocessing as mp

    from p2psync.demo import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=source_worker, args=(r, world, port, cases, results, check)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=240)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def perturb(model: Any, seed: int) -> None:
    """Stand in for a training step: change every weight."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.01)


def megatron_trainer(hf: Any, arch: str, join: Callable[[], J]) -> tuple[J, Any, Callable[[int], None]]:
    """A Megatron-Core trainer rank, TP over the world that `join` joins, holding the weights of the
    transformers model `hf` (so that engines built from the same model agree on every shape): what
    `join` returned, its source and its training step (`perturb`)."""
    import torch.distributed as dist

    from p2psync.adapters.megatron import MegatronSource

    tensors = checkpoint(hf)  # before joining: transformers saves differently once torch.distributed is up
    joined = join()
    model = megatron_model(Case(arch, tp=dist.get_world_size()), hf.config.to_dict())
    load_hf(model, tensors, arch)
    return joined, MegatronSource(model, arch), lambda step: perturb(model, seed=step)


def e2e_trainer(rank: int, opts: Any, port: int, results: Any, engine_ids: Callable[[Any], Sequence[str]]) -> None:
    """A Megatron TP=`opts.trainers` trainer rank for `p2psync.demo.launch` (bind `engine_ids` with
    functools.partial): start from the demo's Qwen3 of `opts.size`, the model the engines build, then
    perturb and sync into `engine_ids(opts)` `opts.updates` times; rank 0 dumps the HF tensors it last sent."""
    from pathlib import Path

    import torch.distributed as dist

    from p2psync.core.session import Session
    from p2psync.demo import build_model, join_trainer_world

    rendezvous, source, step = megatron_trainer(
        build_model(opts.size, seed=0), "qwen3", lambda: join_trainer_world(rank, opts, port)
    )
    engines = list(engine_ids(opts))
    for engine in engines:  # engine ranks that build a real engine's model take longer than connect waits
        rendezvous.read_engine(engine, timeout=600)
    session = Session(source=source, transport=opts.transport, rendezvous=rendezvous,
                      bucket_bytes=opts.bucket_bytes, transfer_timeout=opts.transfer_timeout, check=opts.check)
    session.connect(engines)
    reports = []
    for i in range(opts.updates):
        step(i)  # the same on every rank: replicated tensors stay equal, as in training
        reports.append(session.update(f"step-{i + 1}"))
    full = {n: t.clone() for n, t in source.gather([s.name for s in source.param_specs()]).items()}
    if rank == 0:
        torch.save(full, Path(opts.dump_dir) / "trainer.pt")
    session.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put({"reports": reports, "buckets": session.bucket_count})
