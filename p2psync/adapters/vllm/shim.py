"""Every reach into vLLM internals, pinned to one vLLM version.

The layouts run vLLM's own model classes and loaders outside a vLLM worker: in
a trainer process (which may already have its own torch.distributed world) and
for any TP rank, several ranks in one process. So instead of vLLM's distributed
initialization, the model-parallel groups are set to stand-in coordinators that
only answer rank and size, for the duration of a `rank_state` block. Nothing
here communicates. Each function imports vLLM lazily, so `import p2psync`
never does.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ...layouts import RankModel

if TYPE_CHECKING:
    import torch

VLLM_VERSION = "0.33.0"
#: The model-parallel groups vLLM 0.33.0 keeps in `parallel_state`; all but TP are size 1 here.
_GROUPS = ("_WORLD", "_TP", "_PP", "_DP", "_EP", "_DCP", "_PCP", "_ETP", "_EPLB", "_INNER_DP_WORLD", "_ENGRAM_DP")


def import_vllm() -> Any:
    """Import vLLM, on CPU where there is no GPU, and check its version."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # else configs fail: "Device string must not be empty"
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(
            f"p2psync's vLLM adapter is pinned to vllm=={VLLM_VERSION} (it builds vLLM's model "
            f"classes outside a worker), but vllm {vllm.__version__} is installed"
        )
    return vllm


def version() -> str:
    return import_vllm().__version__


@lru_cache(maxsize=None)
def _config_dir(config_json: str) -> str:
    """A directory holding only `config.json`, kept for the process's life (vLLM reads it lazily)."""
    path = tempfile.mkdtemp(prefix="p2psync-vllm-config-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(config_json)
    return path


def engine_config(
    hf_config: Mapping[str, Any], *, tp: int, dtype: str, extra: tuple[tuple[str, Any], ...] = (),
) -> Any:
    """A VllmConfig for `hf_config` at TP size `tp`, built without weights, tokenizer or devices;
    `extra`: more engine arguments (LoRA's), as (name, value) pairs.

    Cached: building one takes seconds, and every rank of an engine needs the same one."""
    return _engine_config(json.dumps(dict(hf_config), sort_keys=True), tp, dtype, extra)


@lru_cache(maxsize=16)
def _engine_config(config_json: str, tp: int, dtype: str, extra: tuple[tuple[str, Any], ...]) -> Any:
    import_vllm()
    from vllm.engine.arg_utils import EngineArgs

    path = _config_dir(config_json)
    return EngineArgs(
        model=path, tensor_parallel_size=tp, dtype=dtype, skip_tokenizer_init=True,
        enforce_eager=True, load_format="dummy", **dict(extra),
    ).create_engine_config()


class _StandInProcessGroup:
    """Answers what model constructors ask a torch ProcessGroup (MoE blocks read `.size()`)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _stand_in(rank: int, size: int) -> Any:
    """A GroupCoordinator that answers rank and size only (its properties derive from these)."""
    from vllm.distributed.parallel_state import GroupCoordinator

    group = object.__new__(GroupCoordinator)
    process_group = _StandInProcessGroup(rank, size)
    group.__dict__.update(
        unique_name=f"p2psync-stand-in:{rank}/{size}", rank=rank, ranks=list(range(size)), world_size=size,
        rank_in_group=rank, local_rank=rank, device_group=process_group, cpu_group=process_group,
        use_device_communicator=False, device_communicator=None, mq_broadcaster=None,
    )
    return group


@contextmanager
def rank_state(vllm_config: Any, rank: int) -> Iterator[None]:
    """Make vLLM see TP rank `rank` of `vllm_config` (and its config as current) inside the block."""
    import_vllm()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    tp = vllm_config.parallel_config.tensor_parallel_size
    saved = {name: getattr(parallel_state, name, None) for name in _GROUPS}
    for name in _GROUPS:
        setattr(parallel_state, name, _stand_in(0, 1))
    parallel_state._WORLD = _stand_in(rank, tp)
    parallel_state._TP = _stand_in(rank, tp)
    try:
        with set_current_vllm_config(vllm_config):
            yield
    finally:
        for name, group in saved.items():
            setattr(parallel_state, name, group)


def tp_rank() -> int:
    """This worker's TP rank, from vLLM's live parallel state."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def build_model(vllm_config: Any, rank: int, device: str) -> torch.nn.Module:
    """vLLM's model of TP rank `rank`, on `device` ("meta" for no storage), before any load."""
    import torch

    import_vllm()
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    # Attention layers register themselves by name in the config's forward context, which
    # refuses a second model (another rank) built from the same config: give each its own.
    compilation = vllm_config.compilation_config
    shared, compilation.static_forward_context = compilation.static_forward_context, {}
    try:
        dtype = set_default_torch_dtype(vllm_config.model_config.dtype)
        with rank_state(vllm_config, rank), dtype, torch.device(device), _fp8_kernel_stand_in():
            return initialize_model(vllm_config=vllm_config)
    finally:
        compilation.static_forward_context = shared


#: The name `fp8_kernels` reports for `_Fp8KernelStandIn`.
FP8_STAND_IN = "p2psync-cpu-stand-in"


class _Fp8KernelStandIn:
    """Takes the place of vLLM's fp8 linear kernel in rank models built on a machine without CUDA.

    vLLM's `Fp8LinearMethod.create_weights` picks a GEMM kernel after making the parameters, and
    on a CPU without AMX (vLLM's CPU fp8 kernels need it) there is none: the model would not build,
    on meta either. The kernel does not shape the parameters, only how they are multiplied and
    post-processed, and a rank model is never run or post-processed: this stands in. With CUDA,
    vLLM's own choice is made as in an engine.
    """

    name = FP8_STAND_IN

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        raise RuntimeError("p2psync's CPU stand-in for vLLM's fp8 kernel has no post-load step")

    def apply_weights(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("p2psync's CPU stand-in for vLLM's fp8 kernel does not compute")


@contextmanager
def _fp8_kernel_stand_in() -> Iterator[None]:
    import torch

    if torch.cuda.is_available():
        yield
        return
    from vllm.model_executor.layers.quantization import fp8

    chosen = fp8.init_fp8_linear_kernel
    fp8.init_fp8_linear_kernel = lambda **kwargs: _Fp8KernelStandIn()
    try:
        yield
    finally:
        fp8.init_fp8_linear_kernel = chosen


def fp8_kernels(model: torch.nn.Module) -> dict[str, list[str]]:
    """The fp8 GEMM kernels of `model`'s quantized layers (`linear`: vLLM's kernel class, or the CPU
    stand-in; `moe`: its fp8 MoE backend): what decides how vLLM's post-load step rewrites fp8
    weights and scales. Read where the engine runs: it goes into the layout key."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod

    linear, moe = set(), set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, Fp8LinearMethod):
            kernel = method.fp8_linear
            linear.add(getattr(kernel, "name", type(kernel).__name__))
        elif isinstance(method, Fp8MoEMethod):
            moe.add(str(method.fp8_backend))
    return {"linear": sorted(linear), "moe": sorted(moe)}


def attention_scales(model: torch.nn.Module) -> frozenset[str]:
    """The kv-cache scales vLLM gives attention layers of fp8 models (`attn.k_scale`, ...): an fp8
    checkpoint without them leaves them as vLLM set them, and so do layouts."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return frozenset(
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules() if isinstance(module, AttentionLayerBase)
        for name, _ in module.named_parameters(recurse=False)
    )


class VllmRankModel(RankModel):
    """vLLM's model of TP rank `rank` of `vllm_config` on meta, and vLLM's own loader as that rank."""

    def __init__(self, vllm_config: Any, rank: int) -> None:
        self.config = vllm_config
        self.rank = rank
        self.model = build_model(vllm_config, rank, "meta")

    def load(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        load_weights(self.model, self.config, self.rank, items)

    def unloaded_params(self) -> frozenset[str]:
        return attention_scales(self.model)


def load_weights(model: Any, vllm_config: Any, rank: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """vLLM's own `model.load_weights` (its model classes' method), as TP rank `rank` (no post-processing)."""
    with rank_state(vllm_config, rank):
        model.load_weights(weights)


def post_process(model: torch.nn.Module, vllm_config: Any, device: torch.device) -> None:
    """vLLM's post-load step (derived tensors such as MLA's absorbed projections)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with vllm_config_context(vllm_config):
        process_weights_after_loading(model, vllm_config.model_config, device)


@contextmanager
def vllm_config_context(vllm_config: Any) -> Iterator[None]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        yield
