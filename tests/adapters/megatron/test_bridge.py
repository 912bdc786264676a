"""The Megatron-Bridge source: without megatron-bridge it fails saying what to install (environment
py). With it, Bridge's own mappings turn a Megatron model into the HF tensors bit for bit, and
into torch engines (tests/matrix/test_bridge.py, environment bridge).

megatron-bridge 0.3.1 does not import on a CPU machine: `megatron.bridge` imports
`transformer_engine.pytorch` (in `peft/lora_layers.py`), whose PyTorch extension
(transformer-engine-torch) ships only as a CUDA source build, and its core wheel needs cuDNN.
It also pins transformers<5. Installed with `--no-deps`, its mapping modules work on CPU:
the conformance tests load Bridge's DeepSeek mappings without the package `__init__`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from p2psync.core.plugins import registry

BRIDGE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.bridge") is not None


def test_registered_under_its_name() -> None:
    assert registry().trainer_source("megatron-bridge").name == "megatron-bridge"


@pytest.mark.skipif(BRIDGE, reason="megatron-bridge is installed")
def test_without_bridge_the_error_says_what_to_install() -> None:
    from p2psync.adapters.megatron.bridge import registry_of

    with pytest.raises(ImportError, match=r"pip install 'p2psync\[bridge\]'"):
        registry_of(object())


def _bridge_like(adapter_param: str, adapter_class: str = "ParallelLinearAdapter") -> torch.nn.Module:
    """A model holding one module shaped as Bridge's `LoRALinear` (`to_wrap`, `adapter`) at the
    place `adapter_param` names, its adapter of class `adapter_class`."""
    module, _, param = adapter_param.rpartition(".")
    root = torch.nn.Module()
    parent = root
    for part in module.split("."):
        if not hasattr(parent, part):
            parent.add_module(part, torch.nn.Module())
        parent = getattr(parent, part)
    parent.register_parameter(param, torch.nn.Parameter(torch.zeros(2, 2)))
    wrapped = root.get_submodule(adapter_param.split(".adapter.")[0])
    wrapped.add_module("to_wrap", torch.nn.Linear(2, 2))
    adapter = wrapped.get_submodule("adapter")
    adapter.__class__ = type(adapter_class, (torch.nn.Module,), {})
    return root


@pytest.mark.parametrize(("param", "adapter_class", "error"), [
    ("decoder.layers.0.self_attention.linear_qkv.adapter.adapter_q.linear_in.weight", "ModuleDict",
     r"'decoder\.layers\.0\.self_attention\.linear_qkv\.adapter\.adapter_q\.linear_in\.weight' has no PEFT name"),
    ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.adapter.linear_in.weight", "ParallelLinearAdapter",
     r"'decoder\.layers\.0\.mlp\.experts\.local_experts\.1\.linear_fc1\.adapter\.linear_in\.weight' has no PEFT name"),
    ("decoder.layers.0.mlp.linear_fc2.adapter.linear_in.weight", "ParallelLinearDoRAAdapter",
     r"'decoder\.layers\.0\.mlp\.linear_fc2' is a ParallelLinearDoRAAdapter, not LoRA's"),
])
def test_bridge_adapters_without_a_peft_lora_form_are_refused_naming_them(param: str, adapter_class: str,
                                                                          error: str) -> None:
    from p2psync.adapters.megatron.lora import BridgeLoraSource

    with pytest.raises(ValueError, match=error):
        BridgeLoraSource(_bridge_like(param, adapter_class), "qwen3_moe")


def test_lora_rules_name_a_and_b_as_peft_saves_them_split_as_the_base() -> None:
    from p2psync.adapters.megatron.lora import lora_rules
    from p2psync.adapters.megatron.names import Rule, Split, table

    rules = lora_rules(table("qwen3_moe"))
    layer, hf = "decoder.layers.{layer}.", "base_model.model.model.layers.{layer}."
    qkv = tuple(f"{hf}self_attn.{p}_proj.lora_{{}}.weight" for p in "qkv")
    gate_up = tuple(f"{hf}mlp.{p}_proj.lora_{{}}.weight" for p in ("gate", "up"))
    assert rules == {
        layer + "self_attention.linear_qkv.adapter.linear_in.weight": Rule(tuple(n.replace("{}", "A") for n in qkv), Split.REPEAT),
        layer + "self_attention.linear_qkv.adapter.linear_out.weight": Rule(tuple(n.replace("{}", "B") for n in qkv), Split.QKV),
        layer + "self_attention.linear_proj.adapter.linear_in.weight": Rule((f"{hf}self_attn.o_proj.lora_A.weight",)),
        layer + "self_attention.linear_proj.adapter.linear_out.weight": Rule((f"{hf}self_attn.o_proj.lora_B.weight",)),
        layer + "mlp.linear_fc1.adapter.linear_in.weight": Rule(tuple(n.replace("{}", "A") for n in gate_up), Split.REPEAT),
        layer + "mlp.linear_fc1.adapter.linear_out.weight": Rule(tuple(n.replace("{}", "B") for n in gate_up), Split.GATE_UP, 2),
        layer + "mlp.linear_fc2.adapter.linear_in.weight": Rule((f"{hf}mlp.down_proj.lora_A.weight",)),
        layer + "mlp.linear_fc2.adapter.linear_out.weight": Rule((f"{hf}mlp.down_proj.lora_B.weight",)),
    }
