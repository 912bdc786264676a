"""vLLM general plugin (`vllm.general_plugins` entry point): registers the "p2psync"
weight-transfer backend with vLLM's factories, lazily (the backend module is imported
only when selected). vLLM may load plugins several times per process."""

from __future__ import annotations

BACKEND = "p2psync"
MODULE = "p2psync.adapters.vllm.transfer"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, MODULE, "P2PSyncWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, MODULE, "P2PSyncTrainerWeightTransferEngine")
