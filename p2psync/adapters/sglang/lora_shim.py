"""Every reach into sglang's LoRA internals (0.5.23), in one place.

Where sglang keeps an adapter: its loader (`LoRAAdapter.initialize_weights_from_tensors`)
holds the whole adapter on every TP rank, in host memory, normalized (q/k/v stacked into
`qkv_proj`, gate/up into `gate_up_proj`); the rank's memory pool copies its TP slice of it
into a slot of the pool's buffers when a batch first needs the adapter
(`LoRAMemoryPool.load_lora_weight_to_buffer`), and copies it again from host memory after
an eviction. So an update writes the host copy (it survives evictions) and then has sglang
copy it into the adapter's pool slot, if it holds one (`refresh_slot`). sglang is imported
only when a function is called.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ...layouts import RankModel
from ...layouts.rank_model import parameter_tree
from .shim import SglangRankModel, unpin_without_cuda

#: sglang's LoRA kernels that run without CUDA.
CPU_BACKEND = "torch_native"


@dataclass(frozen=True)
class LoraSettings:
    """An sglang engine's LoRA server arguments (`--max-lora-rank`, `--lora-target-modules`,
    `--max-loras-per-batch`: pool slots, `--max-loaded-loras`: adapters held)."""

    max_lora_rank: int
    target_modules: tuple[str, ...]
    max_loras_per_batch: int = 2
    max_loaded_loras: int = 4


@contextmanager
def _pinning_without_cuda() -> Iterator[None]:
    undo = unpin_without_cuda()
    try:
        yield
    finally:
        undo()


def build_lora_manager(rank_model: SglangRankModel, settings: LoraSettings) -> Any:
    """sglang's LoRAManager of one rank (as its ModelRunner builds it), wrapping the rank's model."""
    from sglang.srt.lora.lora_manager import LoRAManager

    backend = CPU_BACKEND if not torch.cuda.is_available() else "triton"
    with rank_model.active(), _pinning_without_cuda():
        return LoRAManager(
            base_model=rank_model.model, base_hf_config=rank_model.model_config.hf_config,
            max_loras_per_batch=settings.max_loras_per_batch, load_config=_load_config(),
            dtype=rank_model.model_config.dtype, server_args=rank_model.server_args, lora_backend=backend,
            max_lora_rank=settings.max_lora_rank, target_modules=list(settings.target_modules), lora_paths=None,
        )


def _load_config() -> Any:
    from sglang.srt.configs.load_config import LoadConfig

    return LoadConfig()


def load_from_tensors(
    rank_model: SglangRankModel, manager: Any, name: str, tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
) -> str:
    """sglang's own `load_lora_adapter_from_tensors` of adapter `name` (PEFT's tensors and
    `adapter_config.json` fields); its id. Raises ValueError with sglang's reason."""
    from sglang.srt.lora.lora_registry import LoRARef

    ref = LoRARef(lora_name=name, lora_path=f"tensors://{name}", pinned=False)
    with rank_model.active(), _pinning_without_cuda():
        result = manager.load_lora_adapter_from_tensors(ref, dict(tensors), {**config, "peft_type": "LORA"})
    if not result.success:
        raise ValueError(result.error_message)
    return str(ref.lora_id)


def unload(rank_model: SglangRankModel, manager: Any, name: str) -> None:
    """sglang's own unload of adapter `name`: its pool slot cleared, its host copy dropped."""
    ref = manager.lora_refs[lora_id(manager, name)]
    with rank_model.active():
        result = manager.unload_lora_adapter(ref)
    if not result.success:
        raise ValueError(result.error_message)


def lora_id(manager: Any, name: str) -> str:
    for uid, ref in manager.lora_refs.items():
        if ref.lora_name == name:
            return str(uid)
    raise ValueError(f"sglang holds no LoRA adapter {name!r} (it holds {sorted(r.lora_name for r in manager.lora_refs.values())})")


def adapter_config(manager: Any, uid: str) -> dict[str, Any]:
    """The adapter's PEFT config as sglang read it (JSON-ready)."""
    from ..peft.lora import json_ready

    return json_ready(manager.configs[uid].hf_config)


def host_weights(manager: Any, uid: str) -> dict[str, torch.Tensor]:
    """The adapter's whole normalized tensors in host memory, as sglang's loader keeps them."""
    adapter = manager.loras[uid]
    weights = {name: t for layer in adapter.layers for name, t in layer.weights.items()}
    return weights | dict(adapter.embedding_layers) | dict(adapter.added_tokens_embeddings)


def refresh_slot(rank_model: SglangRankModel, manager: Any, uid: str) -> None:
    """After the host copy was written: sglang's own copy of it into the adapter's pool slot, if
    it holds one (else sglang copies it when a batch next needs the adapter), and its staging
    copies dropped (with overlap loading, pinned copies of the old bytes)."""
    adapter = manager.loras[uid]
    for layer in adapter.layers:
        layer.pinned_weights.clear()
    adapter.pinned_embedding_layers.clear()
    adapter.pinned_added_tokens_embeddings.clear()
    pool = manager.memory_pool
    slot = pool.uid_to_buffer_id.get(uid)
    if slot is None:
        return
    with rank_model.active(), _pinning_without_cuda():
        pool.load_lora_weight_to_buffer(
            uid, slot, adapter, manager.lora_modules, manager.embed_tokens_module, manager.lm_head_module,
        )
    manager._notify_lora_slots_updated({slot})


def wait_for_device() -> None:
    """Wait until the device has run every kernel queued so far (none without CUDA). sglang's
    overlap scheduler queues the next batch's preparation while the last forward still runs."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def slot_of(rank_model: SglangRankModel, manager: Any, uid: str) -> int:
    """The adapter's pool slot, sglang loading it there first if it holds none (as a batch that
    uses it would)."""
    pool = manager.memory_pool
    with rank_model.active(), _pinning_without_cuda():
        pool.prepare_lora_batch(
            {uid}, manager.loras, manager.lora_modules, dict(manager.lora_refs), manager.embed_tokens_module,
            manager.lm_head_module,
        )
    return int(pool.uid_to_buffer_id[uid])


def slot_buffers(manager: Any, slot: int) -> dict[str, torch.Tensor]:
    """Every pool buffer's view of `slot` on this rank (`A.qkv_proj.0`: layer 0's A of qkv_proj)."""
    pool = manager.memory_pool
    return {
        f"{side}.{module}.{layer}": buffer[slot]
        for side, buffers in (("A", pool.A_buffer), ("B", pool.B_buffer))
        for module, per_layer in buffers.items() for layer, buffer in enumerate(per_layer)
    }


class Normalization(RankModel):
    """sglang's normalization of a PEFT adapter (its loader's `initialize_weights_from_tensors`)
    as a rank model: the normalized tensors as parameters, on meta."""

    def __init__(self, hf_config: Mapping[str, Any], config: Mapping[str, Any],
                 params: Sequence[tuple[str, tuple[int, ...], str]]) -> None:
        from transformers import PretrainedConfig

        self.hf_config = PretrainedConfig.from_dict(dict(hf_config))
        self.config = {**config, "peft_type": "LORA"}
        self.model = parameter_tree(params)

    def load(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        from sglang.srt.lora.lora import LoRAAdapter
        from sglang.srt.lora.lora_config import LoRAConfig

        adapter = LoRAAdapter(
            "layout", LoRAConfig.from_dict(self.config, None, base_vocab_size=self.hf_config.vocab_size),
            self.hf_config, _load_config(), None, base_model=None,
        )
        adapter.initialize_weights_from_tensors({name: _stays(t) for name, t in items})
        params = dict(self.model.named_parameters())  # a layout backs them only while it loads
        for layer in adapter.layers:
            for name, tensor in layer.weights.items():
                params[name].data.copy_(tensor)
        for name, tensor in {**adapter.embedding_layers, **adapter.added_tokens_embeddings}.items():
            params[name].data.copy_(tensor)


def _stays(tensor: torch.Tensor) -> torch.Tensor:
    """sglang's loader moves each tensor to host memory (`.cpu()`), which a meta tensor (a
    layout's shape-only pass over the loader) cannot do: there the tensor stays where it is."""
    if tensor.is_meta:
        tensor.cpu = lambda *args, **kwargs: tensor  # type: ignore[method-assign]
    return tensor
