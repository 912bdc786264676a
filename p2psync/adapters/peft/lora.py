"""One LoRA adapter of a PEFT model, as a trainer source and as an engine's adapter slot.

An adapter travels as PEFT saves it (`get_peft_model_state_dict`): its tensors named
without the adapter's name (`...q_proj.lora_A.weight`), as adapter checkpoints hold them
and engines' adapter loaders read them. Each adapter slot of an engine is an engine id of its own, so that
it has its own version and lease, and an update of one adapter pauses only the requests
routed to that adapter's endpoint. The trainer refuses at connect a slot whose rank,
alpha, target modules or variant differ from its adapter's: alpha and the variant are no
tensor, and a wrong one would scale every update silently.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ...core.errors import ConnectError, where
from ...core.types import TargetTable
from ...engine.slots import AdapterSlots as EngineAdapterSlots
from ..fsdp2.source import FSDP2Source
from ..torch.endpoint import serve

if TYPE_CHECKING:
    from typing import Unpack

    import torch

    from ...core.rendezvous import Rendezvous
    from ...core.transport import Transport
    from ...engine.endpoint import EngineEndpoint
    from ...engine.hooks import EndpointOptions

#: The table extra an adapter slot publishes its `lora_config` under.
LORA_KEY = "lora"
#: The settings of a PEFT LoraConfig that decide what an adapter's tensors mean.
CONFIG_FIELDS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora")


def slot_rejecter(table: TargetTable, *, engine: str, key: str, version: Callable[[], str]) -> Callable[[str], ConnectError]:
    """For an engine's adapter slot: check that this trainer has the engine's own version
    (`version()`, the slot's `layout_key[key]`), then give what makes a ConnectError naming the
    engine, rank and adapter for a reason."""
    adapter = table.extra.get(LORA_KEY, {}).get("adapter")

    def reject(reason: str) -> ConnectError:
        return ConnectError(f"{where(table.engine_id, table.rank)}: LoRA adapter {adapter!r}: {reason}")

    try:
        have = version()
    except (ImportError, RuntimeError) as exc:
        raise reject(f"this trainer cannot build {engine} layouts: {exc}") from exc
    if table.layout_key.get(key) != have:
        raise reject(f"engine runs {engine} {table.layout_key.get(key)}, the trainer has {engine} {have}")
    return reject


def _pattern(adapter: str) -> re.Pattern[str]:
    return re.compile(rf"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.{re.escape(adapter)}(?=\.|$)")


def lora_params(adapter: str) -> Callable[[str], bool]:
    """Whether a PEFT model's parameter name is one of `adapter`'s tensors."""
    pattern = _pattern(adapter)
    return lambda name: pattern.search(name) is not None


def checkpoint_name(adapter: str) -> Callable[[str], str]:
    """A parameter name of `adapter` as PEFT's adapter checkpoint names it (without the adapter)."""
    pattern = _pattern(adapter)
    return lambda name: pattern.sub(r".\1", name, count=1)


def lora_config(model: torch.nn.Module, adapter: str) -> dict[str, Any]:
    """The settings of `adapter` (a PEFT model's `peft_config`) that its tensors' meaning rests on."""
    configs = getattr(model, "peft_config", None)
    if not configs or adapter not in configs:
        have = sorted(configs) if configs else []
        raise ValueError(f"the model has no LoRA adapter {adapter!r} (its adapters: {have})")
    return settings_of(configs[adapter])


def settings_of(config: Any) -> dict[str, Any]:
    """`CONFIG_FIELDS` of a PEFT LoraConfig, or of its fields as `adapter_config.json` holds them."""
    get = config.get if isinstance(config, Mapping) else lambda field: getattr(config, field, None)
    return json_ready({field: get(field) for field in CONFIG_FIELDS})


def json_ready(config: Mapping[str, Any]) -> dict[str, Any]:
    """Adapter config fields with `target_modules` (a set in PEFT's LoraConfig) as a sorted list,
    so that tables and layout keys compare equal."""
    out = dict(config)
    modules = out.get("target_modules")
    if isinstance(modules, (set, list, tuple)):
        out["target_modules"] = sorted(modules)
    return out


def check_slot(table: TargetTable, adapter: str, config: Mapping[str, Any]) -> None:
    """Refuse (ConnectError naming engine, rank and adapter) an engine table that is no adapter
    slot, or whose adapter's `CONFIG_FIELDS` differ from the trainer's adapter `config`."""
    slot = table.extra.get(LORA_KEY)
    if slot is None:
        raise ConnectError(
            f"{where(table.engine_id, table.rank)} publishes no LoRA adapter slot; LoRA adapter "
            f"{adapter!r} updates only adapter slots (serve_lora)"
        )
    differ = [f"{field} {slot.get(field)!r} there, {config[field]!r} here"
              for field in CONFIG_FIELDS if slot.get(field) != config[field]]
    if differ:
        raise ConnectError(
            f"{where(table.engine_id, table.rank)}: its LoRA adapter slot {slot.get('adapter')!r} does not "
            f"match the trainer's adapter {adapter!r}: {'; '.join(differ)}"
        )


class LoraSource(FSDP2Source):
    """One LoRA adapter of a PEFT model (FSDP2-sharded or whole): its A and B tensors under
    PEFT's checkpoint names; the base weights are not sent."""

    name = "peft-lora"
    requires = ("peft", "torch.distributed.fsdp")

    def __init__(self, module: torch.nn.Module, *, adapter: str = "default", process_group: Any = None) -> None:
        self.adapter = adapter
        self.config = lora_config(module, adapter)
        super().__init__(module, name_map=checkpoint_name(adapter), select=lora_params(adapter),
                         process_group=process_group)
        if not self._params:
            raise ValueError(f"LoRA adapter {adapter!r} has no parameters")

    def check_table(self, table: TargetTable) -> None:
        check_slot(table, self.adapter, self.config)


def serve_lora(
    model: torch.nn.Module,
    *,
    adapter: str,
    engine_id: str,
    rendezvous: Rendezvous,
    transport: Transport | str,
    rank: int = 0,
    world_size: int = 1,
    **options: Unpack[EndpointOptions],
) -> EngineEndpoint:
    """Serve `adapter` of a PEFT model as engine `engine_id`: its tensors (registered where the
    model keeps them) under PEFT's checkpoint names, its settings in the table for the
    trainer to check. One call per adapter slot; `options` as the torch engine's `serve`
    (`hooks.routes`: the requests that use this adapter, the only ones its updates pause)."""
    slot = {"adapter": adapter, **lora_config(model, adapter)}
    options["extra"] = {**(options.get("extra") or {}), LORA_KEY: slot}
    return serve(
        model, engine_id=engine_id, rendezvous=rendezvous, transport=transport, rank=rank, world_size=world_size,
        name_map=checkpoint_name(adapter), select=lora_params(adapter), **options,
    )


class AdapterSlots(EngineAdapterSlots):
    """The adapter slots of one PEFT model on one engine rank (`engine.slots.AdapterSlots`):
    slot `adapter` is served with `serve_lora`."""

    def __init__(self, model: Any, *, rendezvous: Rendezvous, transport: str, prefix: str = "", rank: int = 0,
                 world_size: int = 1) -> None:
        super().__init__(rendezvous=rendezvous, transport=transport, prefix=prefix, rank=rank, world_size=world_size)
        self.model = model

    def load(self, adapter: str, config: Any, **options: Unpack[EndpointOptions]) -> EngineEndpoint:
        """Add a new adapter (a PEFT `LoraConfig`) to the model and serve it. It holds PEFT's
        initial weights, of no known version unless `options` declare one: out of serving
        until its first update lands."""
        self.model.add_adapter(adapter, config)
        return self.serve(adapter, **options)

    def _publish(self, adapter: str, engine_id: str, **options: Unpack[EndpointOptions]) -> EngineEndpoint:
        return serve_lora(
            self.model, adapter=adapter, engine_id=engine_id, rendezvous=self.rendezvous, transport=self.transport,
            rank=self.rank, world_size=self.world_size, **options,
        )

    def _forget(self, adapter: str) -> None:
        self.model.delete_adapter(adapter)
