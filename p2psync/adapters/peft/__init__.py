"""LoRA adapters of PEFT models: the trainer sends one adapter's A and B tensors, under the
names of PEFT's adapter checkpoint, into an engine's adapter slot; base weights stay put."""

from .lora import LoraSource, checkpoint_name, lora_config, lora_params, serve_lora

__all__ = ["LoraSource", "checkpoint_name", "lora_config", "lora_params", "serve_lora"]
