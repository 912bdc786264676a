"""Engine side of a vLLM rank: expose its live parameters to trainers.

Used by the `p2psync` weight-transfer backend inside a vLLM worker, and directly
by anything else that holds a vLLM rank model (tests build one per process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...engine.endpoint import EndpointOptions, EngineEndpoint
from ...core.transport import Transport
from .key import layout_key

if TYPE_CHECKING:
    from typing import Unpack

    import torch

    from ...core.rendezvous import Rendezvous


def serve(
    model: torch.nn.Module,
    vllm_config: Any,
    *,
    rank: int,
    engine_id: str,
    rendezvous: Rendezvous,
    transport: Transport | str,
    **options: Unpack[EndpointOptions],
) -> EngineEndpoint:
    """Register the rank's parameters, publish its table (vLLM names, vLLM layout key) and
    serve control calls. The parameters must be those vLLM loads into, before any
    post-processing that changes their bytes or storage. `options`: see `EndpointOptions`."""
    return EngineEndpoint.serve(
        engine="vllm",
        engine_id=engine_id,
        rank=rank,
        world_size=vllm_config.parallel_config.tensor_parallel_size,
        params={name: p.data for name, p in model.named_parameters()},
        layout_key=layout_key(vllm_config, model),
        transport=transport,
        rendezvous=rendezvous,
        **options,
    )
