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

from p2psync.core.plugins import registry

BRIDGE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.bridge") is not None


def test_registered_under_its_name() -> None:
    assert registry().trainer_source("megatron-bridge").name == "megatron-bridge"


@pytest.mark.skipif(BRIDGE, reason="megatron-bridge is installed")
def test_without_bridge_the_error_says_what_to_install() -> None:
    from p2psync.adapters.megatron.bridge import registry_of

    with pytest.raises(ImportError, match=r"pip install 'p2psync\[bridge\]'"):
        registry_of(object())
