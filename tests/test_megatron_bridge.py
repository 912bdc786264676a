"""The Megatron-Bridge source: without megatron-bridge it fails saying what to install.

megatron-bridge 0.3.1 pulls Transformer Engine for CUDA and does not import on a CPU
machine, so its conversion path runs only where Bridge is installed.
"""

from __future__ import annotations

import importlib.util

import pytest

from p2psync.core.plugins import registry


def test_registered_under_its_name() -> None:
    assert registry().trainer_source("megatron-bridge").name == "megatron-bridge"


@pytest.mark.skipif(importlib.util.find_spec("megatron.bridge") is not None, reason="megatron-bridge is installed")
def test_without_bridge_the_error_says_what_to_install() -> None:
    from p2psync.adapters.megatron.bridge import registry_of

    with pytest.raises(ImportError, match=r"pip install 'p2psync\[bridge\]'"):
        registry_of(object())
