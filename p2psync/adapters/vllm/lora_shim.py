"""Every reach into vLLM's LoRA internals (0.33.0), in one place.

Where vLLM keeps an adapter: its `LoRAModel`, whole on every TP rank in host memory, with
q/k/v packed into `qkv_proj` and gate/up into `gate_up_proj` (lists of tensors) and the
adapter's scaling multiplied into B (`LoRAModelManager._create_merged_loras_inplace`); an
active adapter's slot of each LoRA layer's stacked buffers holds the rank's TP slice of it
(`set_lora`), copied again from the host copy whenever the adapter is activated after an
eviction. So an update writes the host copy and then has vLLM copy it into the adapter's
slot, if it holds one (`refresh_slot`). vLLM is imported only when a function is called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...layouts import RankModel
from ...layouts.rank_model import parameter_tree
from .shim import build_model, engine_config, rank_state


@dataclass(frozen=True)
class LoraSettings:
    """A vLLM engine's LoRA arguments (`--max-lora-rank`, `--max-loras`: slots per batch,
    `--max-cpu-loras`: adapters held in host memory)."""

    max_lora_rank: int
    max_loras: int = 2
    max_cpu_loras: int = 3


def lora_engine_config(hf_config: Mapping[str, Any], *, tp: int, dtype: str, settings: LoraSettings) -> Any:
    """A VllmConfig with LoRA enabled (`settings`), built without weights, tokenizer or devices
    (few sequences and tokens: LoRA's batch metadata is sized by them)."""
    lora = (("enable_lora", True), ("max_lora_rank", settings.max_lora_rank), ("max_loras", settings.max_loras),
            ("max_cpu_loras", settings.max_cpu_loras), ("max_num_seqs", 4), ("max_num_batched_tokens", 256),
            ("max_model_len", 256))
    return engine_config(hf_config, tp=tp, dtype=dtype, extra=lora)


def build_lora_manager(vllm_config: Any, rank: int, device: str) -> tuple[torch.nn.Module, Any]:
    """vLLM's model of TP rank `rank` on `device` wrapped by its LoRA manager, as its model
    runner builds them (`LRUCacheWorkerLoRAManager.create_lora_manager`); the worker manager."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    model = build_model(vllm_config, rank, device)
    with rank_state(vllm_config, rank):
        worker = LRUCacheWorkerLoRAManager(vllm_config, torch.device(device), model.embedding_modules)
        model = worker.create_lora_manager(model, vllm_config)
    return model, worker


def lora_model(worker: Any, vllm_config: Any, adapter_id: int, tensors: Mapping[str, torch.Tensor],
               config: Mapping[str, Any], device: torch.device) -> Any:
    """vLLM's LoRAModel of PEFT's tensors and `adapter_config.json` fields (validated as vLLM's
    loader does: ValueError for what it refuses), packed as its manager packs it."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker._adapter_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": worker.max_position_embeddings})
    helper.validate_legal(vllm_config.lora_config)
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    model = LoRAModel.from_lora_tensors(
        adapter_id, {name: t.clone() for name, t in tensors.items()}, helper, device=str(device),
        dtype=vllm_config.lora_config.lora_dtype, model_vocab_size=worker.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
    )  # cloned: vLLM multiplies the scaling into B in place, and tensors already in its dtype are kept
    manager._create_merged_loras_inplace(model)
    return model


def add(worker: Any, vllm_config: Any, rank: int, adapter_id: int, tensors: Mapping[str, torch.Tensor],
        config: Mapping[str, Any]) -> None:
    """vLLM's own load of an adapter from tensors into this rank's host memory (as its worker
    manager's `add_adapter` does from a directory)."""
    with rank_state(vllm_config, rank):
        model = lora_model(worker, vllm_config, adapter_id, tensors, config, torch.device("cpu"))
        manager = worker._adapter_manager
        if not manager.add_adapter(model):
            raise ValueError(f"vLLM holds LoRA adapter id {adapter_id} already")


def remove(worker: Any, adapter_id: int) -> None:
    worker._adapter_manager.remove_adapter(adapter_id)


def host_weights(model: Any) -> dict[str, torch.Tensor]:
    """A LoRAModel's tensors by module: `<module>.lora_a` / `.lora_b`, packed ones per part
    (`qkv_proj.lora_b.1`: k's B, scaled), parts the adapter lacks left out."""
    out = {}
    for module, weights in sorted(model.loras.items()):
        for side in ("lora_a", "lora_b"):
            tensors = getattr(weights, side)
            if isinstance(tensors, list):
                out.update({f"{module}.{side}.{i}": t for i, t in enumerate(tensors) if t is not None})
            else:
                out[f"{module}.{side}"] = tensors
    return out


def adapter(worker: Any, adapter_id: int) -> Any:
    return worker._adapter_manager.get_adapter(adapter_id)


def slot_of(worker: Any, vllm_config: Any, rank: int, adapter_id: int) -> int:
    """The adapter's slot, vLLM activating it first if it holds none (as a batch using it would)."""
    manager = worker._adapter_manager
    with rank_state(vllm_config, rank):
        manager.activate_adapter(adapter_id)
    return int(manager.lora_index_to_id.index(adapter_id))


def refresh_slot(worker: Any, vllm_config: Any, rank: int, adapter_id: int) -> None:
    """After the host copy was written: vLLM's own copy of it into the adapter's slot, if it
    holds one (deactivated and activated again: `activate_adapter` copies nothing for an adapter
    already active)."""
    manager = worker._adapter_manager
    if adapter_id not in manager.lora_index_to_id:
        return
    with rank_state(vllm_config, rank):
        manager.deactivate_adapter(adapter_id)
        manager.activate_adapter(adapter_id)


def slot_buffers(worker: Any, slot: int) -> dict[str, torch.Tensor]:
    """Every LoRA layer's stacked buffers' view of `slot` on this rank."""
    out = {}
    for name, module in worker._adapter_manager.modules.items():
        for side in ("lora_a_stacked", "lora_b_stacked"):
            stacked = getattr(module, side, None)
            parts = stacked if isinstance(stacked, tuple) else (stacked,)
            out.update({f"{name}.{side}.{i}": t[slot] for i, t in enumerate(parts) if t is not None})
    return out


class Packing(RankModel):
    """vLLM's load of a PEFT adapter (`LoRAModel.from_lora_tensors`, then its manager's packing
    and scaling) on a LoRA manager built on meta, as a rank model: the host copy's tensors as
    parameters, on meta."""

    def __init__(self, vllm_config: Any, rank: int, config: Mapping[str, Any],
                 params: Sequence[tuple[str, tuple[int, ...], str]]) -> None:
        self.config, self.rank, self.adapter_config = vllm_config, rank, dict(config)
        _, self.worker = build_lora_manager(vllm_config, rank, "meta")
        self.model = parameter_tree(params)

    def produced_together(self, names: Sequence[str]) -> list[tuple[str, str]]:
        """A module's A and B: vLLM's loader reads them as one LoRA weight."""
        held = set(names)
        return [(name, name.replace(".lora_A.", ".lora_B.")) for name in names
                if ".lora_A." in name and name.replace(".lora_A.", ".lora_B.") in held]

    def load(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        device = items[0][1].device if items else torch.device("cpu")
        with rank_state(self.config, self.rank):
            packed = lora_model(self.worker, self.config, 1, dict(items), self.adapter_config, device)
        params = dict(self.model.named_parameters())  # a layout backs them only while it loads
        for name, tensor in host_weights(packed).items():
            params[name].data.copy_(tensor)
