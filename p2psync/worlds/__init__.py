"""The processes the conformance round trips, the demo and the bench run on one machine.

- `launch`, `launch_worlds`, `join_trainer_world`, `free_port`: the process launcher
  (rendezvous hosted by the launcher, engine processes for the whole run, trainer
  worlds one after another);
- `WorldOptions`, `World`, `run_world`: an engine world started once, every trainer
  kind and transport run against it, each run checked against an oracle that does not
  call the code under test (`World.round_trip` is what `RoundTripTests.round_trip` returns);
- `ModelSpec`, `greedy`, `greedy_gaps`, `PROMPT`: the tiny transformers models the worlds run;
- `start_engine`, `start_fsdp2`: one engine rank or FSDP2 trainer rank of a world, for
  tools that drive their own loop (the bench).

Framework imports (transformers, megatron, sglang, vLLM) happen inside the processes
that need them.
"""

from .engines import engine_ids, start_engine
from .launch import Part, free_port, join_trainer_world, launch, launch_worlds
from .models import PROMPT, TINY_QWEN3, ModelSpec, greedy, greedy_gaps
from .options import RunResult, WorldOptions
from .trainers import start_fsdp2
from .world import World, run_world

__all__ = [
    "PROMPT",
    "TINY_QWEN3",
    "ModelSpec",
    "Part",
    "RunResult",
    "World",
    "WorldOptions",
    "engine_ids",
    "free_port",
    "greedy",
    "greedy_gaps",
    "join_trainer_world",
    "launch",
    "launch_worlds",
    "run_world",
    "start_engine",
    "start_fsdp2",
]
