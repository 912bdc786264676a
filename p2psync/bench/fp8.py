"""The bench's fp8 case (`--fp8 QUANTIZER`): sglang engines serving an fp8 block-quantized
checkpoint of the bench's Qwen3-MoE, and every way quantizing on the trainer, as RL
frameworks do.

The engines' HF config gets the `quantization_config` of an fp8 checkpoint quantized by the
named quantizer (`p2psync.layouts.quantizers`) at the largest block of 128, 64, 32, 16 or 8
that every TP shard divides (sglang refuses a block its split cuts: the `moe` size at TP 2
takes [128, 128], `moe-tiny` [16, 16], at TP 4 [64, 64] and [8, 8]). The p2psync ways
quantize in their layouts (`QuantizedLayout`), with the quantizer given as the sessions'
engine option; the broadcast ways quantize on trainer rank 0 the HF tensors those same
layouts quantize, with the layouts' own quantizer and input dtype
(`quantized_for_broadcast`), so that every way sends the same fp8 bytes.
"""

from __future__ import annotations

from math import gcd
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..layouts.quantizers import Quantizer
    from ..trainer.options import SessionOptions
    from ..trainer.session import Session
    from ..core.types import ParamSpec
    from .broadcast import Quantized
    from .options import BenchOptions

#: The blocks tried, largest first: [128, 128] as fp8 checkpoints hold, smaller where TP shards need it.
BLOCKS = (128, 64, 32, 16, 8)
#: The engine kinds the fp8 bench runs.
ENGINES = ("sglang",)


def check(opts: BenchOptions) -> None:
    """Raise ValueError for an fp8 bench the engines cannot run, before anything starts."""
    if opts.fp8 is None:
        return
    from ..layouts import quantizers

    if opts.fp8 not in quantizers.NAMES:
        raise ValueError(f"unknown fp8 quantizer {opts.fp8!r}; choose one of {list(quantizers.NAMES)}")
    if opts.engine not in ENGINES:
        raise ValueError(f"--fp8 runs {', '.join(ENGINES)} engines, not {opts.engine}")
    quantizer(opts)


def block(size: str, tp: int) -> int:
    """The largest of `BLOCKS` that divides every TP shard sglang checks against the block: each
    rank's rows of q, k, v (KV heads replicated where TP exceeds them) and of an expert's gate and
    up, and its columns of o_proj and of an expert's down."""
    from .model import MOE_CONFIGS

    c = MOE_CONFIGS[size]
    head_dim, inter = c["head_dim"], c["moe_intermediate_size"]
    shards = (c["num_attention_heads"] * head_dim // tp, max(1, c["num_key_value_heads"] // tp) * head_dim, inter // tp)
    common = 0
    for shard in shards:
        common = gcd(common, shard)
    fits = [b for b in BLOCKS if common % b == 0]
    if not fits:
        raise ValueError(f"no fp8 block of {list(BLOCKS)} divides the TP {tp} shards {shards} of size {size!r}")
    return fits[0]


def quantizer(opts: BenchOptions) -> Quantizer | None:
    """The engines' quantizer (None: bf16 engines)."""
    if opts.fp8 is None:
        return None
    from ..layouts import quantizers

    if opts.fp8 in quantizers.PER_TENSOR:
        return quantizers.get(opts.fp8)
    edge = block(opts.size, opts.engine_tp)  # fp8 runs sglang engines, of engine_tp ranks each
    return quantizers.get(opts.fp8, [edge, edge])


def setup(opts: BenchOptions) -> dict[str, Any]:
    """The engines' fp8 quantizer and block, for the run's setup (nothing for bf16 engines)."""
    chosen = quantizer(opts)
    if chosen is None:
        return {}
    return {"fp8": {"quantizer": chosen.name, "block": list(chosen.block) if chosen.block else None}}


def engine_config(opts: BenchOptions) -> dict[str, Any]:
    """The HF config the engines serve: the bench's model, with an fp8 checkpoint's
    `quantization_config` where `--fp8` is given."""
    from .model import hf_config

    config = hf_config(opts.size)
    chosen = quantizer(opts)
    if chosen is not None:
        config["quantization_config"] = chosen.quantization_config()
    return config


def session_options(opts: BenchOptions) -> SessionOptions:
    """The bench's session options, naming `--fp8`'s quantizer for the engines' layouts."""
    if opts.fp8 is None:
        return opts.session
    from ..trainer.options import SessionOptions

    options = {**opts.session.engine_options, opts.engine: {"quantizer": opts.fp8}}
    return SessionOptions.of(opts.session, engine_options=options)


def quantized_for_broadcast(session: Session, specs: dict[str, ParamSpec]) -> Quantized | None:
    """What the broadcast quantizes: the HF tensors the session's layouts quantize for any rank
    of its first engine (the engines are alike), by those layouts' quantizer from their input
    dtype. None where the engines are not fp8. Compiles that engine's layouts again, through its
    engine target with the session's engine options (untimed, before the first update)."""
    from ..layouts.quantized import QuantizedLayout
    from .broadcast import Quantized

    tables = next(iter(session.tables.values()))
    engine = tables[0].engine
    target = session.registry.engine_target(engine)(**session.options.engine_options.get(engine, {}))
    layouts = [target.layout(table, specs) for table in tables]
    fp8 = [layout for layout in layouts if isinstance(layout, QuantizedLayout)]
    if not fp8:
        return None
    if len({(layout.quantizer, layout.dtype) for layout in fp8}) > 1:
        raise RuntimeError(f"the ranks of {tables[0].engine_id} quantize differently: {[l.quantizer for l in fp8]}")
    names = frozenset().union(*(layout.quantized for layout in fp8))
    return Quantized(names, fp8[0].quantizer, fp8[0].dtype)
