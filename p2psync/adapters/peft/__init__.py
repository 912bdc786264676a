"""LoRA adapters of PEFT models: the trainer sends one adapter's A and B tensors, under the
names of PEFT's adapter checkpoint, into an engine's adapter slot; base weights stay put. Merge
mode (`MergedLoraSource`) sends the base weights with an adapter merged in, into any engine."""

from .lora import AdapterSlots, LoraSource, checkpoint_name, lora_config, lora_params, serve_lora, settings_of
from .merge import MergedLoraSource, base_name

__all__ = [
    "AdapterSlots", "LoraSource", "MergedLoraSource", "base_name", "checkpoint_name", "lora_config", "lora_params",
    "serve_lora", "settings_of",
]
