"""TrainerSource for Megatron-Bridge's LoRA adapters on a Megatron-Core model (`megatron.bridge.peft.lora.LoRA`).

Bridge wraps each targeted linear as `LoRALinear(to_wrap, adapter)`, the adapter's `linear_in` (A)
and `linear_out` (B) being Megatron linears sharded over TP like their base: for a
column-parallel base (`linear_qkv`, `linear_fc1`) A is split over its rank rows and B over the
base's output rows, each rank's rows laid out as the base's (its query groups' q, k and v; its
[gate; up]); for a row-parallel base (`linear_proj`, `linear_fc2`) A is split over its input
columns and B over its rows. They travel as PEFT saves an adapter
(`base_model.model.<module>.lora_A.weight`, `lora_B.weight`): a fused linear's A under each
of its HF modules (PEFT keeps one A per module, as Bridge's own export repeats it), its B split
as the base weight splits. So the conversion is the Megatron source's, gathering or gather-free,
with rules derived from the base weights' (`lora_rules`). Bridge scales by alpha/dim, PEFT by
lora_alpha/r: the same. Base weights are not sent.

Refused at construction, naming the parameter: Bridge's canonical LoRA (its separate q, k and
v adapters), DoRA, and adapters on other modules than `TARGETS` (experts among them: Bridge's
expert adapters build only on Transformer Engine's grouped linears, which do not build here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..peft.lora import check_slot
from .names import Rule, Split, canonical, table
from .source import MegatronSource, unwrap

if TYPE_CHECKING:
    from ...core.types import TargetTable

#: Where PEFT's adapter checkpoint puts a transformers model's modules.
PEFT_PREFIX = "base_model.model."
#: The Megatron linears whose Bridge LoRA adapters map to PEFT's (Bridge's default targets).
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_ADAPTER = ".adapter."


def _is_adapter(name: str) -> bool:
    return _ADAPTER in name


def _renamed(hf: str, prefix: str, matrix: str) -> str:
    return f"{prefix}{hf.removesuffix('.weight')}.{matrix}.weight"


def lora_rules(base: Mapping[str, Rule], prefix: str = PEFT_PREFIX) -> dict[str, Rule]:
    """Rules of the A and B of each `TARGETS` linear's adapter, derived from its base weight's
    rule: A (`linear_in`) repeated under every HF module the base splits into, B (`linear_out`)
    split as the base is, with the base's stride (a gated fc1's B holds each rank's [gate; up])."""
    out: dict[str, Rule] = {}
    for name, rule in base.items():
        module = name.removesuffix(".weight")
        if module == name or ".experts." in name or module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        a = tuple(_renamed(h, prefix, "lora_A") for h in rule.hf)
        b = tuple(_renamed(h, prefix, "lora_B") for h in rule.hf)
        out[f"{module}{_ADAPTER}linear_in.weight"] = Rule(a, Split.REPEAT if len(a) > 1 else Split.COPY)
        out[f"{module}{_ADAPTER}linear_out.weight"] = Rule(b, rule.split, 2 if rule.split is Split.GATE_UP else None)
    return out


def _settings(chunks: Sequence[Any], base: Mapping[str, Rule], lora: Mapping[str, Rule]) -> dict[str, Any]:
    """The adapter's PEFT settings (`peft.lora.CONFIG_FIELDS`) as every rank's modules say them,
    after refusing what `lora` does not map."""
    import torch.distributed as dist

    dims: set[tuple[int, float]] = set()
    modules: set[str] = set()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if _is_adapter(name) and canonical(name).name not in lora:
                raise ValueError(
                    f"Megatron-Bridge adapter parameter {name!r} has no PEFT name: only LoRA adapters "
                    f"(megatron.bridge.peft.lora.LoRA, not canonical LoRA or DoRA) on {', '.join(TARGETS)} "
                    f"outside the experts are sent"
                )
        for name, module in chunk.named_modules():
            adapter = getattr(module, "adapter", None)
            if adapter is None or not hasattr(module, "to_wrap"):
                continue
            if type(adapter).__name__ != "ParallelLinearAdapter":
                raise ValueError(f"Megatron-Bridge adapter {name!r} is a {type(adapter).__name__}, not LoRA's "
                                 f"ParallelLinearAdapter: it has no PEFT LoRA form")
            dims.add((adapter.dim, adapter.alpha))
            rule = base[canonical(f"{name}.weight").name]
            modules.update(h.removesuffix(".weight").rsplit(".", 1)[-1] for h in rule.hf)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(dims), sorted(modules)))
    dims = {d for rank_dims, _ in everyone for d in map(tuple, rank_dims)}
    if len(dims) != 1:
        raise ValueError(f"Megatron-Bridge LoRA adapters of one model must share one (dim, alpha); found {sorted(dims)}")
    ((dim, alpha),) = dims
    targets = sorted({m for _, rank_modules in everyone for m in rank_modules})
    return {"r": dim, "lora_alpha": alpha, "target_modules": targets, "use_rslora": False, "use_dora": False}


class BridgeLoraSource(MegatronSource):
    """The LoRA adapter that Megatron-Bridge's `LoRA` put on a Megatron-Core GPTModel (or its
    virtual-pipeline chunks), as PEFT adapter `adapter`'s tensors. `architecture` (or `rules`)
    as MegatronSource takes them: the base weights' HF names, from which the adapters' are
    derived. Construct on every rank; it refuses at connect an engine slot whose PEFT settings
    differ (`peft.lora.check_slot`)."""

    name = "megatron-bridge-lora"
    requires = ("megatron.bridge",)

    def __init__(self, model: Any | Sequence[Any], architecture: str, *, adapter: str = "default",
                 rules: Mapping[str, Rule] | None = None, prefix: str = PEFT_PREFIX) -> None:
        chunks = [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
        base = dict(rules) if rules is not None else table(architecture)
        lora = lora_rules(base, prefix)
        self.adapter = adapter
        self.config = _settings(chunks, base, lora)
        super().__init__(model, architecture, rules=lora, select=_is_adapter)
        if not self._entries:
            raise ValueError("the model has no Megatron-Bridge LoRA adapter on this pipeline stage")

    def check_table(self, table: TargetTable) -> None:
        check_slot(table, self.adapter, self.config)
