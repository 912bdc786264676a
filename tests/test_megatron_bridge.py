"""The Megatron-Bridge source: without megatron-bridge it fails saying what to install; with it,
Bridge's own mappings turn a Megatron model into the HF tensors bit for bit.

megatron-bridge 0.3.1 does not import on a CPU machine: `megatron.bridge` imports
`transformer_engine.pytorch` (in `peft/lora_layers.py`), whose PyTorch extension
(transformer-engine-torch) ships only as a CUDA source build, and its core wheel needs cuDNN.
It also pins transformers<5. Installed with `--no-deps`, its mapping modules work on CPU:
the conversion test loads Bridge's DeepSeek mappings without the package `__init__`.
"""

from __future__ import annotations

import importlib.util

import pytest

from p2psync.core.plugins import registry

BRIDGE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.bridge") is not None
NOT_INSTALLED = (
    "megatron-bridge is not installed; 0.3.1 needs transformer-engine[pytorch] (a CUDA build: "
    "transformer-engine-torch is an sdist that reads torch.version.cuda) and transformers<5"
)


def test_registered_under_its_name() -> None:
    assert registry().trainer_source("megatron-bridge").name == "megatron-bridge"


@pytest.mark.skipif(BRIDGE, reason="megatron-bridge is installed")
def test_without_bridge_the_error_says_what_to_install() -> None:
    from p2psync.adapters.megatron.bridge import registry_of

    with pytest.raises(ImportError, match=r"pip install 'p2psync\[bridge\]'"):
        registry_of(object())


@pytest.mark.skipif(not BRIDGE, reason=NOT_INSTALLED)
def test_bridge_mappings_yield_the_hf_tensors() -> None:
    """MLA DeepSeek-V3 (dense layers: Bridge maps experts by TE's names only), TP2 x PP2: each
    PP stage's tensors reach every rank through Bridge's broadcast."""
    pytest.importorskip("megatron.core", reason="the Megatron-Bridge source needs megatron-core")
    pytest.importorskip("transformers", reason="the test compares with a transformers model")
    from megatron_harness import Case, check_bridge, run_world

    case = Case("deepseek_v3", tp=2, pp=2, variant="dense")
    assert run_world(4, [case], check_bridge) == {case.id: []}
