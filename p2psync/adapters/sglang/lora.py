"""sglang's LoRA adapters as p2psync adapter slots: the engine side of one rank (`LoraRank`,
`serve_lora`, `SglangAdapterSlots`) and the layout key the trainer rebuilds a slot from.

Each slot publishes the adapter's host copy, where sglang's loader keeps the whole adapter
on every rank (see `lora_shim`): the trainer's PEFT tensors are stacked there as sglang
stacks them, and after each update sglang's own copy refreshes the adapter's pool slot,
which holds the rank's TP slice. An update of adapter A pauses only A's endpoint: requests
on other adapters go on (sglang serves them from their own slots).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...engine.endpoint import EngineEndpoint
from ...engine.hooks import EngineHooks
from ...engine.slots import EngineRankSlots
from ..peft.lora import LORA_KEY, settings_of
from .key import config_hash
from .lora_shim import LoraSettings, adapter_config, host_weights, lora_id, refresh_slot, wait_for_device
from .shim import SglangRankModel, hf_config_dict

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Unpack

    import torch

    from ...core.rendezvous import Rendezvous
    from ...core.transport import Transport
    from ...engine.hooks import EndpointOptions

#: The engine kind of an sglang adapter slot (`target.SglangLoraTarget`).
ENGINE = "sglang-lora"


@dataclass
class LoraRank:
    """One TP rank of an sglang engine serving LoRA: its model, its LoRAManager, and the LoRA
    server arguments it runs with. In a server, `between_batches(fn)` runs `fn` on the
    scheduler's thread between two forward passes and returns once it ran: slots are then
    written into staging copies, applied there (see `serve_lora`)."""

    rank_model: SglangRankModel
    manager: Any  # sglang's LoRAManager of the rank
    rank: int
    settings: LoraSettings
    between_batches: Callable[[Callable[[], None]], None] | None = None

    @property
    def world_size(self) -> int:
        return int(self.rank_model.server_args.tp_size)


def lora_key(lora: LoraRank, uid: str) -> dict[str, Any]:
    """What decides a slot's bytes: the sglang version, the base model's HF config (sglang's
    normalization reads its layers) and the adapter's PEFT config as sglang read it."""
    import sglang

    hf_config = hf_config_dict(lora.rank_model.model_config)
    return {"sglang": sglang.__version__, "config": hf_config, "config_sha256": config_hash(hf_config),
            "adapter": adapter_config(lora.manager, uid)}


def serve_lora(
    lora: LoraRank, *, adapter: str, engine_id: str, rendezvous: Rendezvous, transport: Transport | str,
    **options: Unpack[EndpointOptions],
) -> EngineEndpoint:
    """Serve sglang adapter `adapter` of this rank as engine `engine_id`, its settings in the
    table for the trainer to check. Outside a server its host copy is registered in place,
    and after each update sglang's own copy into its pool slot runs before any hook's
    `post_process`. In a server (`between_batches`), updates land in a staging copy while
    requests on the adapter keep running (the slot's only pause mode is "in_place": sglang
    cannot hold one adapter's requests), and the finish applies it between two forward
    passes: every pass sees the adapter's old bytes or its new ones, never a mix. Requests on
    the adapter in flight then go on attending to KV its old bytes computed, as "in_place"
    says (a server with a prefix cache is refused where slots are served: new requests would
    reuse that KV too)."""
    uid = lora_id(lora.manager, adapter)
    host = host_weights(lora.manager, uid)
    hooks = options.get("hooks") or EngineHooks()
    then = hooks.post_process
    if lora.between_batches is None:
        params = host

        def post_process() -> None:
            refresh_slot(lora.rank_model, lora.manager, uid)
            then()
    else:
        params = {name: tensor.clone() for name, tensor in host.items()}
        run_between_batches = lora.between_batches

        def apply() -> None:
            wait_for_device()  # overlap scheduling: the last batch's forward may still read the slot
            for name, tensor in params.items():
                host[name].copy_(tensor)
            refresh_slot(lora.rank_model, lora.manager, uid)

        def post_process() -> None:
            run_between_batches(apply)
            then()

        hooks = dataclasses.replace(hooks, pause_modes=("in_place",))
    options["hooks"] = dataclasses.replace(hooks, post_process=post_process)
    key = lora_key(lora, uid)
    options["extra"] = {**(options.get("extra") or {}), LORA_KEY: {"adapter": adapter, **settings_of(key["adapter"])}}
    return EngineEndpoint.serve(
        engine=ENGINE, engine_id=engine_id, rank=lora.rank, world_size=lora.world_size,
        params=params, layout_key=key, transport=transport, rendezvous=rendezvous, **options,
    )


class SglangAdapterSlots(EngineRankSlots):
    """The adapter slots of one sglang rank (`engine.slots.AdapterSlots`), served with `serve_lora`."""

    lora: LoraRank

    def __init__(self, lora: LoraRank, *, rendezvous: Rendezvous, transport: str, prefix: str = "") -> None:
        super().__init__(lora, rendezvous=rendezvous, transport=transport, prefix=prefix)
        self.lora = lora

    def load(self, adapter: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
             **options: Unpack[EndpointOptions]) -> EngineEndpoint:
        """Load a new adapter with sglang's own loader (PEFT's tensors and config fields: its
        refusals, such as a rank above `--max-lora-rank`, are raised as ValueError naming the
        rank and adapter), then serve it. Its bytes are of no known version unless `options`
        declare one: out of serving until its first update lands."""
        from .lora_shim import load_from_tensors

        def load() -> None:
            load_from_tensors(self.lora.rank_model, self.lora.manager, adapter, tensors, config)

        # sglang's server checks --max-loaded-loras in its tokenizer manager, not its LoRAManager
        return self._load_new(adapter, load, engine="sglang", held=len(self.lora.manager.lora_refs),
                              limit=self.lora.settings.max_loaded_loras, limit_flag="--max-loaded-loras", **options)

    def _publish(self, adapter: str, engine_id: str, **options: Unpack[EndpointOptions]) -> EngineEndpoint:
        return serve_lora(self.lora, adapter=adapter, engine_id=engine_id, rendezvous=self.rendezvous,
                          transport=self.transport, **options)

    def _forget(self, adapter: str) -> None:
        from .lora_shim import unload

        unload(self.lora.rank_model, self.lora.manager, adapter)
