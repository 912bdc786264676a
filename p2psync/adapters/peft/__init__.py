"""LoRA adapters of PEFT models: the trainer sends one adapter's A and B tensors, under the
names of PEFT's adapter checkpoint, into an engine's adapter slot; base weights stay put."""

from .lora import AdapterSlots, LoraSource, checkpoint_name, lora_config, lora_params, serve_lora

__all__ = ["AdapterSlots", "LoraSource", "checkpoint_name", "lora_config", "lora_params", "serve_lora"]
