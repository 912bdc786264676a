"""vLLM's LoRA adapters as p2psync adapter slots: the engine side of one rank (`LoraRank`,
`serve_lora`, `VllmAdapterSlots`, `lora_rank` on CPU) and the layout key a slot is rebuilt from.

Each slot publishes the adapter's host copy, where vLLM keeps the whole adapter on every rank
(see `lora_shim`): q/k/v and gate/up packed, the scaling multiplied into B, as vLLM's own loader
leaves them; after each update vLLM's own copy refreshes the adapter's slot of the stacked
buffers (the rank's TP slice), so an adapter evicted and activated again brings the new bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...engine.endpoint import EngineEndpoint
from ...engine.hooks import EngineHooks
from ...engine.slots import EngineRankSlots
from ..peft.lora import LORA_KEY, json_ready, settings_of
from .lora_shim import LoraSettings, adapter, host_weights, refresh_slot

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Unpack

    import torch

    from ...core.rendezvous import Rendezvous
    from ...core.transport import Transport
    from ...engine.hooks import EndpointOptions

#: The engine kind of a vLLM adapter slot (`target.VllmLoraTarget`).
ENGINE = "vllm-lora"


@dataclass
class LoraRank:
    """One TP rank of a vLLM engine serving LoRA: its config (LoRA enabled), its worker LoRA
    manager, and the adapters it holds by name (vLLM knows them by integer id): an adapter
    loaded outside `VllmAdapterSlots.load` is served once `ids` and `configs` name it."""

    vllm_config: Any
    worker: Any  # vLLM's LRUCacheWorkerLoRAManager of the rank
    rank: int
    hf_config: dict[str, Any]
    settings: LoraSettings
    ids: dict[str, int] = field(default_factory=dict)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return int(self.vllm_config.parallel_config.tensor_parallel_size)


def lora_rank(hf_config: Mapping[str, Any], settings: LoraSettings, *, tp: int, rank: int,
              dtype: str = "bfloat16") -> LoraRank:
    """vLLM's model of TP rank `rank` on CPU with its LoRA manager, as an engine started with
    `--enable-lora` and `settings` builds them, holding no adapter yet."""
    from .lora_shim import build_lora_manager, lora_engine_config

    config = lora_engine_config(hf_config, tp=tp, dtype=dtype, settings=settings)
    _, worker = build_lora_manager(config, rank, "cpu")
    return LoraRank(config, worker, rank, dict(hf_config), settings)


def lora_key(lora: LoraRank, name: str) -> dict[str, Any]:
    """What decides a slot's bytes: the vLLM version, the base model's HF config, TP size, dtype
    and LoRA settings (the trainer rebuilds the rank's LoRA manager from them) and the adapter's
    PEFT config."""
    from .shim import version

    return {"vllm": version(), "hf_config": lora.hf_config, "tp": lora.world_size,
            "dtype": str(lora.vllm_config.model_config.dtype).removeprefix("torch."),
            "lora": dataclasses.asdict(lora.settings), "adapter": lora.configs[name]}


def serve_lora(
    lora: LoraRank, *, adapter_name: str, engine_id: str, rendezvous: Rendezvous, transport: Transport | str,
    **options: Unpack[EndpointOptions],
) -> EngineEndpoint:
    """Serve vLLM adapter `adapter_name` of this rank as engine `engine_id`: its host copy
    registered in place, its settings in the table for the trainer to check; after each update,
    vLLM's own copy into its slot runs before any hook's `post_process`."""
    adapter_id = lora.ids[adapter_name]
    hooks = options.get("hooks") or EngineHooks()
    then = hooks.post_process

    def post_process() -> None:
        refresh_slot(lora.worker, lora.vllm_config, lora.rank, adapter_id)
        then()

    options["hooks"] = dataclasses.replace(hooks, post_process=post_process)
    key = lora_key(lora, adapter_name)
    options["extra"] = {**(options.get("extra") or {}),
                        LORA_KEY: {"adapter": adapter_name, **settings_of(key["adapter"])}}
    return EngineEndpoint.serve(
        engine=ENGINE, engine_id=engine_id, rank=lora.rank, world_size=lora.world_size,
        params=host_weights(adapter(lora.worker, adapter_id)), layout_key=key, transport=transport,
        rendezvous=rendezvous, **options,
    )


class VllmAdapterSlots(EngineRankSlots):
    """The adapter slots of one vLLM rank (`engine.slots.AdapterSlots`), served with `serve_lora`."""

    lora: LoraRank

    def __init__(self, lora: LoraRank, *, rendezvous: Rendezvous, transport: str, prefix: str = "") -> None:
        super().__init__(lora, rendezvous=rendezvous, transport=transport, prefix=prefix)
        self.lora = lora

    def load(self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
             **options: Unpack[EndpointOptions]) -> EngineEndpoint:
        """Load a new adapter with vLLM's own loader (PEFT's tensors and config fields: its
        refusals, such as a rank above `--max-lora-rank`, are raised as ValueError naming the
        rank and adapter), then serve it, out of serving until its first update unless
        `options` declare a version."""
        from .lora_shim import add

        adapter_id = max(self.lora.ids.values(), default=0) + 1

        def load() -> None:
            add(self.lora.worker, self.lora.vllm_config, self.rank, adapter_id, tensors, config)
            self.lora.ids[name], self.lora.configs[name] = adapter_id, json_ready(config)

        return self._load_new(name, load, engine="vLLM", held=len(self.lora.ids),
                              limit=self.lora.settings.max_cpu_loras, limit_flag="--max-cpu-loras", **options)

    def _publish(self, adapter: str, engine_id: str, **options: Unpack[EndpointOptions]) -> EngineEndpoint:
        return serve_lora(self.lora, adapter_name=adapter, engine_id=engine_id, rendezvous=self.rendezvous,
                          transport=self.transport, **options)

    def _forget(self, adapter: str) -> None:
        from .lora_shim import remove

        remove(self.lora.worker, self.lora.ids.pop(adapter))
        self.lora.configs.pop(adapter)

