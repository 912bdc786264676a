"""Every reach into sglang internals, in one place, pinned to one sglang version.

sglang builds a rank's model only inside a launched server. To build the model of
TP rank r on a trainer (on the meta device, no storage) or in a test process (on
CPU), this module publishes a runtime context for that rank, builds sglang's
parallel groups from placeholder group objects that answer ranks and sizes but
never communicate, and calls sglang's own model initializer. All imports of
sglang are inside functions, so importing p2psync never imports sglang.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...layouts import RankModel

#: The sglang release whose internals this shim was written and tested against.
SGLANG_VERSION = "0.5.23"


def require_sglang() -> str:
    """Import sglang, check its version, apply the CPU fix; return the version."""
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"p2psync's sglang adapter supports sglang {SGLANG_VERSION} only, but sglang "
            f"{sglang.__version__} is installed; install sglang=={SGLANG_VERSION}"
        )
    _fix_cpu()
    return sglang.__version__


def _fix_cpu() -> None:
    """On a machine without CUDA, RotaryEmbedding must take its CPU path: otherwise
    it imports `vllm._custom_ops`. sglang decides this once, at import."""
    if not torch.cuda.is_available():
        import sglang.srt.layers.rotary_embedding.base as rotary

        rotary._is_cpu = True


@dataclass(frozen=True)
class RankSpec:
    """What decides a rank model: the HF config and the server arguments that shape it."""

    hf_config: dict[str, Any]
    tp_size: int
    ep_size: int
    dtype: str
    rank: int
    quantization: str | None = None
    moe_a2a_backend: str = "none"
    moe_runner_backend: str = "auto"
    #: The rank also runs sglang's MTP (NextN) draft of the same checkpoint (`TargetAndDraft`).
    draft: bool = False


class _Group:
    """A stand-in for sglang's GroupCoordinator: ranks and sizes of one group, no communication."""

    def __init__(self, group_ranks: Sequence[Sequence[int]], rank: int, name: str | None) -> None:
        self.ranks = next(list(g) for g in group_ranks if rank in g)
        self.rank = rank
        self.local_rank = rank
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(rank)
        self.unique_name = name or "group"
        self.device_group = None
        self.cpu_group = None
        self.pynccl_comm = None

    first_rank = property(lambda self: self.ranks[0])
    last_rank = property(lambda self: self.ranks[-1])
    is_first_rank = property(lambda self: self.rank == self.ranks[0])
    is_last_rank = property(lambda self: self.rank == self.ranks[-1])

    def destroy(self) -> None:
        return None


@dataclass
class SglangRankModel(RankModel):
    """sglang's model of one rank and the runtime context its loaders read."""

    model: Any  # sglang's model class: a torch.nn.Module with sglang's own methods (load_weights)
    context: Any
    server_args: Any
    model_config: Any

    @contextmanager
    def active(self) -> Iterator[None]:
        """Make this rank's parallel context the process's while sglang code runs."""
        from sglang.srt.runtime_context import use_context

        with use_context(self.context):
            yield

    def load(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """sglang's own `load_weights` for these HF tensors."""
        with self.active():
            self.model.load_weights(list(items))

    def unloaded_params(self) -> frozenset[str]:
        return attention_scales(self.model)

    def post_load(self) -> None:
        post_load(self.model)


class TargetAndDraft(torch.nn.Module):
    """One sglang rank that runs a speculative draft worker beside its model: the target's modules
    under their own names, the draft's under `draft.`. The draft's embedding and
    LM head are the target's parameters, as sglang's EAGLE worker shares them
    (`set_embed_and_head`), so they are published, written and checked once, under the target's
    names. Loading and the post-load step run the target's, then the draft's in sglang's draft
    scope (`draft_scope`)."""

    target: Any  # sglang's model classes, as in SglangRankModel
    draft: Any

    def __init__(self, target: Any, draft: Any) -> None:
        super().__init__()
        self._parameters.update(target._parameters)
        self._modules.update(target._modules)
        self.draft = draft
        object.__setattr__(self, "target", target)  # not a submodule: its modules are ours already

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        weights = list(weights)
        self.target.load_weights(weights)
        with draft_scope():
            self.draft.load_weights(weights)

    def post_load_weights(self) -> None:
        from sglang.srt.model_loader.loader import post_load_weights

        post_load_weights(self.target)
        post_load_weights(self.draft)

@contextmanager
def draft_scope() -> Iterator[None]:
    """What sglang's EAGLE worker enters to build and load its draft (`EAGLEWorkerV2.__init__`):
    the speculative MoE backends and the draft's construction settings. Its one-stage pipeline
    group and draft TP context are the target's own here: `key.rank_spec` refuses pipeline
    parallelism and data-parallel attention."""
    from sglang.srt.layers.moe.utils import (
        draft_model_build_scope,
        speculative_moe_a2a_backend_context,
        speculative_moe_backend_context,
    )

    with speculative_moe_backend_context(), speculative_moe_a2a_backend_context(), draft_model_build_scope():
        yield


def share_embed_and_head(target: Any, draft: Any) -> None:
    """Give the draft the target's embedding and LM head, through the draft's own
    `set_embed_and_head` (which waits for the CUDA device: without one, nothing to wait for)."""
    embed, head = target.get_embed_and_head()
    if torch.cuda.is_available():
        draft.set_embed_and_head(embed, head)
        return
    sync = torch.cuda.synchronize
    torch.cuda.synchronize = _no_device_to_wait_for
    try:
        draft.set_embed_and_head(embed, head)
    finally:
        torch.cuda.synchronize = sync


def attention_scales(model: torch.nn.Module) -> frozenset[str]:
    """The kv-cache scales sglang gives attention layers of fp8 models (DeepSeek's `attn_mqa.k_scale`):
    an fp8 checkpoint without them leaves them as sglang set them, and so do layouts."""
    from sglang.srt.layers.radix_attention import RadixAttention

    return frozenset(
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules() if isinstance(module, RadixAttention)
        for name, _ in module.named_parameters(recurse=False)
    )


def fp8_post_load_settings() -> dict[str, Any]:
    """What decides, in this process, whether sglang's step after loading an fp8 checkpoint
    (`process_weights_after_loading` of its fp8 methods) rewrites the fp8 weights and scales
    (sglang 0.5.23, `layers/quantization/fp8.py`): the platform (ROCm converts to e4m3fnuz and may
    shuffle for aiter), SGLANG_USE_CPU_ENGINE (AMX prepacking on CPU), and DeepGEMM with UE8M0
    scales (Blackwell: [128, 128] scales requantized to powers of two and packed). Evaluated
    where the engine runs: it goes into the layout key."""
    require_sglang()
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.quantization import fp8

    platforms = (
        ("hip", fp8._is_hip), ("npu", fp8._is_npu), ("xpu", fp8._is_xpu), ("musa", fp8._is_musa), ("cuda", fp8._is_cuda)
    )
    platform = next((name for name, on in platforms if on), "cpu")
    return {
        "platform": platform,
        "cpu_amx_engine": bool(fp8._is_cpu),
        "deepgemm_ue8m0": bool(deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM and deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0),
    }


def post_load(model: torch.nn.Module) -> None:
    """sglang's own steps after bytes reach the parameters without `load_weights` (an engine runs
    them after each update, once the new bytes are in place): the model's post-load step
    (DeepSeek's MLA derives `w_kc`/`w_vc` from `kv_b_proj`), then what its presharded loader
    redoes after writing parameters directly (a Gemma norm's `gemma_weight` buffer, 1 + w)."""
    from sglang.srt.model_loader.loader import PreshardedModelLoader, post_load_weights

    post_load_weights(model)
    PreshardedModelLoader._rebind_parameter_aliases(model)


def derives_after_load(model: torch.nn.Module) -> bool:
    """Whether sglang computes tensors from the parameters after loading (`post_load`): an engine
    written to directly must redo that after each update."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    return hasattr(model, "post_load_weights") or any(isinstance(m, GemmaRMSNorm) for m in model.modules())


def hf_config_dict(model_config: Any) -> dict[str, Any]:
    """The HF config sglang's ModelConfig holds, as a JSON-ready dict."""
    return json.loads(model_config.hf_config.to_json_string(use_diff=False))


def server_args(model_path: str, spec: RankSpec, device: str = "cpu") -> Any:
    """ServerArgs of a rank as the trainer rebuilds it: only what shapes the weights."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=model_path,
        tp_size=spec.tp_size,
        ep_size=spec.ep_size,
        dtype=spec.dtype,
        quantization=spec.quantization,
        moe_a2a_backend=spec.moe_a2a_backend,
        moe_runner_backend=spec.moe_runner_backend,
        device=device,
        load_format="dummy",
        skip_tokenizer_init=True,
        **(_DRAFT_ARGS | dict(
            speculative_draft_model_path=model_path,
            speculative_moe_runner_backend=spec.moe_runner_backend,
            speculative_moe_a2a_backend=spec.moe_a2a_backend,
        ) if spec.draft else {}),
    )


#: Server arguments of an MTP draft that do not shape its weights (one step, top 1).
_DRAFT_ARGS = dict(
    speculative_algorithm="NEXTN", speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2,
)


def build_rank_model(spec: RankSpec, device: str) -> SglangRankModel:
    """Build sglang's model of `spec.rank` on `device` ("meta": no storage; "cpu": real memory)."""
    import torch.distributed as dist

    require_sglang()
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, create_context, use_context

    if not dist.is_initialized():  # sglang asserts a default group; a private world of one does
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="p2psync-sglang-") as model_path:
        (Path(model_path) / "config.json").write_text(json.dumps(spec.hf_config))
        args = server_args(model_path, spec)
        with _capability_without_cuda():
            context = create_context(args, role="scheduler", ranks=SpawnRanks(world_rank=spec.rank))
        with use_context(context):
            _init_groups(parallel_state, spec)
            initialize_moe_config()  # as sglang's scheduler does: the MoE backends of target and draft
            model_config = ModelConfig.from_server_args(args)
            # what sglang's own loader passes: the checkpoint's quantization (fp8) or None
            quant_config = _get_quantization_config(model_config, LoadConfig())
            with set_default_torch_dtype(model_config.dtype), torch.device(device):
                model = _initialize_model(model_config, LoadConfig(), quant_config)
                if spec.draft:
                    draft_config = ModelConfig.from_server_args(args, is_draft_model=True)
                    with draft_scope():
                        draft = _initialize_model(
                            draft_config, LoadConfig(), _get_quantization_config(draft_config, LoadConfig())
                        )
                    share_embed_and_head(model, draft)
                    model = TargetAndDraft(model, draft)
    return SglangRankModel(model.eval(), context, args, model_config)


@contextmanager
def _capability_without_cuda() -> Iterator[None]:
    """sglang resolves the server defaults of DeepSeek sparse attention (KV-cache dtype, kernels)
    from the CUDA device's capability, which a machine without CUDA cannot answer. None of those
    defaults shapes a weight, so there the resolution is told Hopper's (9, 0)."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = original


_GROUP_GLOBALS = (
    "_TP", "_PP", "_DCP", "_ATTN_TP", "_ATTN_CP", "_SHARED_EXPERTS_TP",
    "_MOE_DP", "_MOE_EP", "_MOE_TP", "_SELF_PP", "_PDMUX_PREFILL_TP_GROUP",
)


def _init_groups(parallel_state: Any, spec: RankSpec) -> None:
    """Run sglang's own group layout (which rank is in which TP/EP group) with stand-in groups."""
    from sglang.srt.runtime_context import get_parallel

    world = list(range(spec.tp_size))
    get_parallel().override_permanently(world_group=_Group([world], spec.rank, "world"))
    for name in _GROUP_GLOBALS:  # sglang refuses to build groups twice in one process
        setattr(parallel_state, name, None)
    original = parallel_state.init_model_parallel_group
    parallel_state.init_model_parallel_group = lambda group_ranks, *a, group_name=None, **k: _Group(
        group_ranks, spec.rank, group_name
    )
    try:
        parallel_state.initialize_model_parallel(backend="gloo", recovered_rank=True)
    finally:
        parallel_state.init_model_parallel_group = original
        for name in _GROUP_GLOBALS:
            setattr(parallel_state, name, None)


def patch_server_for_cpu() -> None:
    """Fixes a real sglang server needs on a machine without CUDA, applied in each of its processes.

    sglang registers weight memory with Mooncake from the CUDA allocator's memory
    snapshot, which is empty on CPU, so every write would be refused; its older
    per-parameter registration covers CPU memory. A draft model's `set_embed_and_head`
    calls `torch.cuda.synchronize()`, which fails without a CUDA driver: with no device,
    there is nothing to wait for.
    """
    if torch.cuda.is_available():
        return
    require_sglang()
    from sglang.srt.model_executor.model_runner_components import remote_instance_weight_transporter as transporter
    from sglang.srt.model_loader import loader, remote_instance_weight_loader_utils as utils

    transporter.register_memory_region = utils.register_memory_region_v1
    unpin_without_cuda()
    loader.register_memory_region = utils.register_memory_region_v1
    torch.cuda.synchronize = _no_device_to_wait_for


#: The tensor factories sglang's LoRA code asks for pinned memory (`pin_memory=True`).
_PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")


def unpin_without_cuda() -> Callable[[], None]:
    """sglang's LoRA layers, backends and pool stage host copies in pinned memory, which needs a
    CUDA driver; without one nothing is copied to a device, so the tensors stay pageable.
    Returns what undoes it."""
    if torch.cuda.is_available():
        return lambda: None
    originals = {name: getattr(torch, name) for name in _PINNING_FACTORIES}
    pin = torch.Tensor.pin_memory

    def unpinned(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def make(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            return factory(*args, **kwargs)
        return make

    def undo() -> None:
        for name, factory in originals.items():
            setattr(torch, name, factory)
        torch.Tensor.pin_memory = pin  # type: ignore[method-assign]

    for name, factory in originals.items():
        setattr(torch, name, unpinned(factory))
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    return undo


def _no_device_to_wait_for(*args: Any, **kwargs: Any) -> None:
    return None


def on_model_loaded(callback: Any) -> None:
    """Call `callback(model, server_args, model_config, tp_rank, draft)` in each sglang scheduler once
    its weights are in place, through sglang's plugin hook registry: after the model loads, or, in a
    server running an MTP/EAGLE draft worker (`draft_follows`), after that worker has loaded and taken
    the target's embedding and head (`EagleDraftWorker.init_lm_head`), with `draft` its model."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.runtime_context import get_parallel

    def after_load(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
        if not runner.is_draft_worker and not draft_follows(runner.server_args):
            callback(runner.model, runner.server_args, runner.model_config, get_parallel().tp_rank, None)
        return result

    def after_lm_head(result: Any, worker: Any, *args: Any, **kwargs: Any) -> Any:
        target = worker.target_worker.model_runner
        callback(target.model, target.server_args, target.model_config, get_parallel().tp_rank, worker.draft_runner.model)
        return result

    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.load_model", after_load, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_lm_head", after_lm_head, HookType.AFTER
    )


def draft_follows(server_args: Any) -> bool:
    """Whether the server builds an EAGLE draft worker (`EagleDraftWorker`) after its model: EAGLE or
    NEXTN, one layer. Other drafts are not published; the layout key then refuses them by name."""
    algorithm = str(server_args.speculative_algorithm or "").upper()
    return algorithm in ("EAGLE", "NEXTN") and not server_args.enable_multi_layer_eagle
