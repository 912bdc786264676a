"""Per-rank parameter shapes of an engine, by layer kind, without building a model.

A `ShapeModel` holds, for each engine rank, the parameters of each *part*:
`embed` (first pipeline stage), one entry per layer kind (`dense`, `moe`: layers
of one kind hold the same shapes, so each kind is computed once and multiplied),
and `final` (norm and head, last stage). `layer_kinds[i]` names the kind of layer i.

`analytic_shapes` follows sglang's sharding rules (the same rules the sglang
adapter's meta-device rank model applies; `sglang_shapes` in `engine.py` reads
them from that model): column/row-parallel attention and MLP over TP (KV heads
replicated when TP exceeds them), fused `qkv_proj`/`gate_up_proj`, experts over
EP with `tp/ep`-way TP inside an expert (`w13_weight`, `w2_weight`), replicated
norms, routers and MLA down-projections, vocab padded to 64 (times TP when it
does not divide) and split over TP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import ceil, prod
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
FP8_BLOCK = 128  # block-quantized fp8 (DeepSeek/Kimi style): one float32 scale per 128x128 block


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass
class RankShapes:
    """One engine rank's parameters, per part."""

    parts: dict[str, list[Param]]

    def part_bytes(self, part: str) -> int:
        return sum(p.nbytes for p in self.parts.get(part, ()))

    def part_count(self, part: str) -> int:
        return len(self.parts.get(part, ()))


@dataclass
class ShapeModel:
    source: str  # what produced the shapes, for the output
    layer_kinds: list[str]
    ranks: list[RankShapes]
    full: RankShapes  # the unsharded model (tp = ep = 1): what the broadcast path sends
    numel_total: int = 0
    notes: list[str] = field(default_factory=list)

    def rank_bytes(self, rank: int, layers: range, embed: bool, final: bool) -> tuple[int, int]:
        """(bytes, parameter count) of `rank` for these layers (and embed/final parts)."""
        return _bytes_of(self.ranks[rank], self.layer_kinds, layers, embed, final)

    def full_bytes(self, layers: range, embed: bool, final: bool) -> tuple[int, int]:
        return _bytes_of(self.full, self.layer_kinds, layers, embed, final)

    def full_expert_bytes(self, layers: range, embed: bool, final: bool) -> int:
        """Bytes of the routed experts' tensors among `full_bytes` (a trainer gathers them
        over its expert-parallel group, the rest over tensor parallel)."""
        return _bytes_of(self.full, self.layer_kinds, layers, embed, final, is_routed_expert)[0]


def is_routed_expert(param: Param) -> bool:
    return ".experts." in param.name  # `mlp.experts.w13_weight`; shared experts are `mlp.shared_experts.*`


def _bytes_of(
    rs: RankShapes, kinds: list[str], layers: range, embed: bool, final: bool,
    select: Callable[[Param], bool] | None = None,
) -> tuple[int, int]:
    nbytes = count = 0
    for part, n in _multiplicity(kinds, layers, embed, final).items():
        params = [p for p in rs.parts.get(part, ()) if select is None or select(p)]
        nbytes += n * sum(p.nbytes for p in params)
        count += n * len(params)
    return nbytes, count


def _multiplicity(kinds: list[str], layers: range, embed: bool, final: bool) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in layers:
        out[kinds[i]] = out.get(kinds[i], 0) + 1
    if embed:
        out["embed"] = 1
    if final:
        out["final"] = 1
    return out


def layer_kinds(cfg: dict[str, Any]) -> list[str]:
    n = int(cfg["num_hidden_layers"])
    if "n_routed_experts" in cfg:  # DeepSeek / Kimi / GLM-4.5
        k = int(cfg.get("first_k_dense_replace", 0))
        freq = int(cfg.get("moe_layer_freq", 1))
        return ["moe" if i >= k and i % freq == 0 else "dense" for i in range(n)]
    if _qwen_experts(cfg):  # Qwen MoE
        step = int(cfg.get("decoder_sparse_step", 1))
        only = set(cfg.get("mlp_only_layers") or [])
        return ["moe" if i not in only and (i + 1) % step == 0 else "dense" for i in range(n)]
    return ["dense"] * n


def _qwen_experts(cfg: dict[str, Any]) -> int:
    """Routed experts of a Qwen-style MoE config (`num_experts`; newer transformers write `num_local_experts`)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def _pad_vocab(vocab: int, tp: int, pad: int = 64) -> int:
    padded = ceil(vocab / pad) * pad
    if padded % tp:
        padded = ceil(vocab / (pad * tp)) * pad * tp
    return padded


def _div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} does not divide by {b}")
    return a // b


class _Builder:
    """Parameters of one rank in engine dtype `dtype` ("bfloat16" or "fp8", with a float32 scale
    per `fp8_block` x `fp8_block` block)."""

    def __init__(
        self, cfg: dict[str, Any], tp: int, ep: int, dtype: str, dp_attention: bool = False, fp8_block: int = FP8_BLOCK
    ) -> None:
        self.cfg, self.tp, self.ep, self.block = cfg, tp, ep, fp8_block
        self.attn_tp = 1 if dp_attention else tp  # DP attention: every rank holds the whole attention
        self.fp8 = dtype == "fp8"
        self.act = {"fp8": "bfloat16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
        if self.act not in DTYPE_BYTES:
            raise ValueError(f"dtype {dtype!r}: use bf16, fp8, fp16 or fp32")

    def linear(self, out: list[Param], name: str, rows: int, cols: int, *, bias: bool = False, quant: bool = True,
               experts: int = 0) -> None:
        lead = (experts,) if experts else ()
        if self.fp8 and quant:
            out.append(Param(f"{name}.weight" if not experts else name, (*lead, rows, cols), "float8_e4m3fn"))
            scale = (*lead, ceil(rows / self.block), ceil(cols / self.block))
            out.append(Param(f"{name}.weight_scale_inv" if not experts else f"{name}_scale_inv", scale, "float32"))
        else:
            out.append(Param(f"{name}.weight" if not experts else name, (*lead, rows, cols), self.act))
        if bias:
            out.append(Param(f"{name}.bias", (rows,), self.act))

    def norm(self, out: list[Param], name: str, size: int) -> None:
        out.append(Param(f"{name}.weight", (size,), self.act))

    def attention(self, out: list[Param]) -> None:
        c, tp, h = self.cfg, self.attn_tp, int(self.cfg["hidden_size"])
        heads = int(c["num_attention_heads"])
        hp = _div(heads, tp, "attention heads over engine TP")
        if c.get("kv_lora_rank"):  # MLA (DeepSeek-V3, Kimi-K2)
            rope, nope, v = int(c["qk_rope_head_dim"]), int(c["qk_nope_head_dim"]), int(c["v_head_dim"])
            kvl, ql = int(c["kv_lora_rank"]), c.get("q_lora_rank")
            if ql:
                self.linear(out, "self_attn.fused_qkv_a_proj_with_mqa", int(ql) + kvl + rope, h)
                self.norm(out, "self_attn.q_a_layernorm", int(ql))
                self.linear(out, "self_attn.q_b_proj", hp * (nope + rope), int(ql))
            else:
                self.linear(out, "self_attn.q_proj", hp * (nope + rope), h)
                self.linear(out, "self_attn.kv_a_proj_with_mqa", kvl + rope, h)
            self.norm(out, "self_attn.kv_a_layernorm", kvl)
            self.linear(out, "self_attn.kv_b_proj", hp * (nope + v), kvl)
            self.linear(out, "self_attn.o_proj", h, hp * v)
            if self.fp8:  # the kv-cache scales sglang gives an fp8 model's MLA attention (1.0 unless loaded)
                scales = [f"self_attn.{a}.{s}" for a in ("attn_mqa", "attn_mha") for s in ("k_scale", "v_scale")]
                out += [Param(name, (), "float32") for name in scales]
            if c.get("index_topk"):  # DeepSeek sparse attention's indexer (V3.2, GLM-5): replicated
                heads_i, dim_i = int(c["index_n_heads"]), int(c["index_head_dim"])
                self.linear(out, "self_attn.indexer.wq_b", heads_i * dim_i, int(ql or h))
                self.linear(out, "self_attn.indexer.wk", dim_i, h)
                self.linear(out, "self_attn.indexer.weights_proj", heads_i, h, quant=False)
                out += [Param(f"self_attn.indexer.k_norm.{w}", (dim_i,), "float32") for w in ("weight", "bias")]
            return
        hd = int(c.get("head_dim") or h // heads)
        kv = int(c.get("num_key_value_heads") or heads)
        kvp = max(1, kv // tp) if tp >= kv else _div(kv, tp, "KV heads over engine TP")
        bias = bool(c.get("attention_bias")) or c.get("model_type") == "qwen2"  # Qwen2: q/k/v biases, always
        self.linear(out, "self_attn.qkv_proj", (hp + 2 * kvp) * hd, h, bias=bias)
        self.linear(out, "self_attn.o_proj", h, hp * hd)
        if c.get("model_type", "").startswith("qwen3") or c.get("use_qk_norm"):
            self.norm(out, "self_attn.q_norm", hd)
            self.norm(out, "self_attn.k_norm", hd)

    def mlp(self, out: list[Param], prefix: str, inter: int) -> None:
        ip = _div(inter, self.tp, f"{prefix} intermediate size over engine TP")
        self.linear(out, f"{prefix}.gate_up_proj", 2 * ip, int(self.cfg["hidden_size"]))
        self.linear(out, f"{prefix}.down_proj", int(self.cfg["hidden_size"]), ip)

    def moe(self, out: list[Param]) -> None:
        c, h = self.cfg, int(self.cfg["hidden_size"])
        experts = int(c.get("n_routed_experts") or _qwen_experts(c))
        inter = int(c["moe_intermediate_size"])
        local = _div(experts, self.ep, "routed experts over engine EP")
        moe_tp = _div(self.tp, self.ep, "engine TP over EP (tp/ep ways inside an expert)")
        ip = _div(inter, moe_tp, "expert intermediate size over tp/ep")
        # the router: sglang keeps GLM-4.5's (and any `router_fp32` config's) in float32
        fp32_router = c.get("router_fp32") or "Glm4Moe" in (c.get("architectures") or [""])[0]
        out.append(Param("mlp.gate.weight", (experts, h), "float32" if fp32_router else self.act))
        if "n_routed_experts" in c and c.get("topk_method", "noaux_tc") == "noaux_tc":
            out.append(Param("mlp.gate.e_score_correction_bias", (experts,), "float32"))
        self.linear(out, "mlp.experts.w13_weight", 2 * ip, h, experts=local)
        self.linear(out, "mlp.experts.w2_weight", h, ip, experts=local)
        shared = int(c.get("n_shared_experts") or 0)
        if shared:
            self.mlp(out, "mlp.shared_experts", inter * shared)

    def layer(self, kind: str) -> list[Param]:
        out: list[Param] = []
        h = int(self.cfg["hidden_size"])
        self.norm(out, "input_layernorm", h)
        self.attention(out)
        self.norm(out, "post_attention_layernorm", h)
        if kind == "moe":
            self.moe(out)
        else:
            self.mlp(out, "mlp", int(self.cfg["intermediate_size"]))
        return out

    def rank(self, kinds: set[str]) -> RankShapes:
        c, h = self.cfg, int(self.cfg["hidden_size"])
        vp = _pad_vocab(int(c["vocab_size"]), self.tp) // self.tp
        parts = {"embed": [Param("model.embed_tokens.weight", (vp, h), self.act)]}
        for kind in sorted(kinds):
            parts[kind] = [Param(f"model.layers.*.{p.name}", p.shape, p.dtype) for p in self.layer(kind)]
        final = [Param("model.norm.weight", (h,), self.act)]
        if not c.get("tie_word_embeddings"):
            final.append(Param("lm_head.weight", (vp, h), self.act))
        parts["final"] = final
        return RankShapes(parts)


#: Architectures whose sglang sharding the analytic model follows (checked against sglang's meta models).
ANALYTIC_ARCHITECTURES = (
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM", "Glm4MoeForCausalLM",
    "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
)


def analytic_shapes(
    cfg: dict[str, Any], tp: int, ep: int, dtype: str, why: str = "", dp_attention: bool = False,
    fp8_block: int = FP8_BLOCK,
) -> ShapeModel:
    """Shapes of every rank of an engine of `tp` ranks (experts over `ep`), by sglang's rules;
    with `dp_attention` every rank holds the whole attention (data-parallel attention, as
    vLLM's and sglang's DP attention do), the rest as without; fp8 scales per `fp8_block`."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ANALYTIC_ARCHITECTURES:
        raise ValueError(
            f"the analytic shape model knows {', '.join(ANALYTIC_ARCHITECTURES)}, not {arch}; "
            "with sglang installed, --shapes sglang reads any architecture sglang supports"
        )
    kinds = layer_kinds(cfg)
    builder = _Builder(cfg, tp, ep, dtype, dp_attention, fp8_block)
    one = builder.rank(set(kinds))
    # Under these rules every rank of a (divisible) engine holds the same shapes: compute one, share it.
    ranks = [one] * tp
    full_model = _Builder(cfg, 1, 1, dtype, fp8_block=fp8_block).rank(set(kinds))
    numel = 0
    bf = _Builder(cfg, 1, 1, "bf16").rank(set(kinds))
    for part, n in _multiplicity(kinds, range(len(kinds)), True, True).items():
        numel += n * sum(prod(p.shape) for p in bf.parts[part])
    source = "analytic shapes" + (", DP attention" if dp_attention else "") + (f" ({why})" if why else "")
    return ShapeModel(source=source, layer_kinds=kinds, ranks=ranks, full=full_model, numel_total=numel)
