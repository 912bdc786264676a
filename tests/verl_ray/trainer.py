"""The one stand-in: the trainer worker."""

from __future__ import annotations

from typing import Any

from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.import_utils import import_external_libs

from .model import trained_state_dict


class StandInTrainer(Worker):
    """Stands in for verl's ActorRolloutRefWorker (FSDP/Megatron on GPU), and for it alone: everything else
    (CheckpointEngineManager, SGLangReplica, its server and checkpoint-engine workers, p2psync's backend) is
    verl's and p2psync's own code. It has the two methods CheckpointEngineManager calls on the actor group,
    builds its checkpoint engine from the rollout config as the real worker does, and sends, at its n-th update,
    `trained_state_dict(model_dir, n)`: the servers' checkpoint plus noise, so that every update changes every
    parameter."""

    def __init__(self, ce_config: Any, model_dir: str) -> None:
        super().__init__()
        import_external_libs(ce_config.custom_backend_module or None)
        kw = dict(ce_config.engine_kwargs.get(ce_config.backend, {}) or {})
        self.ce = CheckpointEngineRegistry.new(ce_config.backend, bucket_size=1 << 20,
                                               is_master=(self.rank == 0), **kw)
        self.model_dir = model_dir
        self.updates = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, float]:
        self.updates += 1
        sd = trained_state_dict(self.model_dir, self.updates)
        return await self.ce.send_weights(iter(sd.items()), global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.ce, method)(*args, **kwargs)
