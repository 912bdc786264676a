"""TrainerSource for Megatron-Core GPT models (TP, PP, virtual PP, EP, expert-TP).

Sender group: all ranks of one pipeline stage (tensor x context x data parallel
ranks; the expert grid re-divides the same ranks). Each stage gathers and sends
only its own layers, so stages never wait on each other.

Gather-free (`local_shards`): each rank describes, per HF tensor, the elements its own shard
holds after the name and layout conversion (`shards.place`: TP column and row splits, fused
QKV per query group, stacked gate/up, the vocabulary padding dropped, whole experts per EP
rank, expert TP). The stage is the sender group, so every element must be claimed by exactly
one of its ranks: a tensor held alike by several ranks (DP and CP replicas, and TP ranks for
a tensor TP does not split) is claimed by one of them, chosen round-robin by the tensor's
position in the stage, so that the writes spread over every rank of the stage
instead of leaving the DP replicas idle (`shards.claims`); the others claim nothing of it.

Gathering, per bucket:
- non-expert tensors: all-gather over the TP group along `partition_dim`,
  honouring `partition_stride`; every DP replica does the same, so every rank
  of the stage ends with the same tensors;
- expert tensors: all-gather over the expert-TP group, then each EP rank
  broadcasts its experts over the EP group (one flat message per EP rank and
  dtype). So every rank of the stage yields *all* experts: a stage is one sender
  group, which the core requires (an engine parameter such as a fused `w13` of
  all experts needs inputs from every EP rank, and non-expert tensors must not
  be served by several groups). The price is that each rank receives a bucket's
  experts once; `bucket_bytes` bounds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from ...core.gloo import all_gather_by_broadcasts, is_gloo
from ...core.source import LocalShard, TrainerSource
from ...core.types import ParamSpec, SenderGroup, numel
from .convert import Heads, split, unshard
from .names import Rule, canonical, table
from .shards import Placed, Sharding, claims, place

if TYPE_CHECKING:
    import torch

#: HF tensors whose rows are the (padded) vocabulary.
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class _Entry:
    """One Megatron tensor of this stage and the HF tensors it becomes.

    For an expert held by another EP rank, `tensor` is this rank's expert of the
    same local index: same shape, dtype and sharding, used for those only."""

    tensor: torch.Tensor
    rule: Rule
    hf: tuple[str, ...]
    owner: int | None  # EP rank holding this expert; None for non-expert tensors

    @property
    def partition(self) -> tuple[int, int]:
        """`(partition_dim, partition_stride)`: the attributes Megatron sets on a tensor-parallel
        parameter (the stride the rule's, where it says one)."""
        stride = self.rule.stride or self.tensor.partition_stride  # type: ignore[attr-defined]
        return self.tensor.partition_dim, stride  # type: ignore[attr-defined]

    def split(self, full: torch.Tensor, heads: Heads) -> tuple[torch.Tensor, ...]:
        """The HF tensors of this entry's full tensor `full`, in the order of `hf`."""
        return split(full, self.rule.split, heads, copies=len(self.hf))


def unwrap(model: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


class MegatronSource(TrainerSource):
    """A Megatron-Core GPTModel (or the list of its virtual-pipeline chunks) on this rank.

    `architecture` is the HF `model_type` whose names to produce (see
    `names.ARCHITECTURES`, or pass `rules`). `vocab_size` drops Megatron's vocabulary
    padding from the embedding and output rows. `select`: which Megatron parameters to send
    (default all; the others need no rule). Construct on every rank after
    `parallel_state.initialize_model_parallel`.
    """

    name = "megatron"
    requires = ("megatron.core",)

    def __init__(
        self,
        model: Any | Sequence[Any],
        architecture: str,
        *,
        vocab_size: int | None = None,
        rules: Mapping[str, Rule] | None = None,
        select: Callable[[str], bool] | None = None,
    ) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        chunks = [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
        config = chunks[0].config
        self._heads = Heads(
            config.num_attention_heads, config.num_query_groups or config.num_attention_heads, config.kv_channels
        )
        self._vocab_size = vocab_size
        self._tp = ps.get_tensor_model_parallel_group()
        self._etp = ps.get_expert_tensor_parallel_group()
        self._ep = ps.get_expert_model_parallel_group()
        self._ep_rank = ps.get_expert_model_parallel_rank()
        self._ep_ranks = dist.get_process_group_ranks(self._ep)
        # (TP, replicas) of dense and of expert tensors: the ranks that hold each tensor alike
        self._grids = {
            False: (self._tp, ps.get_data_parallel_group(with_context_parallel=True)),
            True: (self._etp, ps.get_expert_data_parallel_group()),
        }
        stage = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        self._group = SenderGroup(
            f"pp{ps.get_pipeline_model_parallel_rank()}", tuple(dist.get_process_group_ranks(stage)), dist.get_rank()
        )
        self._select = select
        self._entries = self._build(chunks, dict(rules) if rules is not None else table(architecture), architecture)
        self._by_hf = {name: e for e in self._entries for name in e.hf}
        self._specs = [spec for e in self._entries for spec in self._entry_specs(e)]
        self._placed: dict[str, tuple[_Entry, Placed]] | None = None

    # -- what this stage holds ---------------------------------------------------------------

    def _build(self, chunks: list[Any], rules: dict[str, Rule], architecture: str) -> list[_Entry]:
        num_experts = getattr(chunks[0].config, "num_moe_experts", None) or 0
        local_experts = num_experts // len(self._ep_ranks)
        keyed: list[tuple[tuple[int, int, int], _Entry]] = []
        expert_block: dict[tuple[int, int | None], int] = {}
        for index, (c, name, tensor) in enumerate(_tensors(chunks)):
            if self._select is not None and not self._select(name):
                continue
            canon = canonical(name)
            rule = rules.get(canon.name)
            if rule is None:
                if isinstance(tensor, _Buffer):
                    continue
                raise ValueError(f"Megatron parameter {name!r} has no HF name for architecture {architecture!r}")
            if canon.name == "output_layer.weight" and getattr(chunks[c], "share_embeddings_and_output_weights", False):
                continue  # tied: HF has only the embedding
            layer = chunks[c].decoder.layers[canon.layer].layer_number - 1 if canon.layer is not None else None
            if canon.expert is None:
                keyed.append(((index, -1, index), _Entry(tensor.param, rule, _names(rule, layer, None), None)))
                continue
            block = expert_block.setdefault((c, canon.layer), index)
            for owner in range(len(self._ep_ranks)):
                expert = owner * local_experts + canon.expert
                entry = _Entry(tensor.param, rule, _names(rule, layer, expert), owner)
                keyed.append(((block, expert, index), entry))
        return [e for _, e in sorted(keyed, key=lambda k: k[0])]

    def _entry_specs(self, entry: _Entry) -> Iterator[ParamSpec]:
        import torch

        shape = list(entry.tensor.shape)
        if getattr(entry.tensor, "tensor_model_parallel", False):
            shape[entry.partition[0]] *= self._group_size(entry)
        dtype = str(entry.tensor.dtype).removeprefix("torch.")
        for name, t in zip(entry.hf, entry.split(torch.empty(shape, device="meta"), self._heads)):
            yield ParamSpec(name, tuple(self._trim(name, t).shape), dtype)

    def _group_size(self, entry: _Entry) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self._etp if entry.owner is not None else self._tp)

    def _trim(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[: self._vocab_size] if self._vocab_size and name in _VOCAB_ROWS else tensor

    # -- TrainerSource ---------------------------------------------------------------------

    def sender_group(self) -> SenderGroup:
        return self._group

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def bucket_kind(self, name: str) -> str:
        """Experts are gathered over the expert-TP and EP groups, the rest over TP: keep
        them in separate buckets."""
        return "expert" if self._by_hf[name].owner is not None else ""

    def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        wanted = set(names)
        entries = list({id(self._by_hf[n]): self._by_hf[n] for n in names}.values())
        out: dict[str, torch.Tensor] = {}
        for entry in entries:
            if entry.owner is None or entry.owner == self._ep_rank:
                full = self._unshard(entry)
                for name, t in zip(entry.hf, entry.split(full, self._heads)):
                    if name in wanted:
                        out[name] = self._trim(name, t)
        if len(self._ep_ranks) > 1:
            self._share_experts([n for e in entries if e.owner is not None for n in e.hf if n in wanted], out)
        return {n: out[n] for n in names}

    def _unshard(self, entry: _Entry) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        tensor = entry.tensor.detach()
        size = self._group_size(entry)
        if size == 1 or not getattr(entry.tensor, "tensor_model_parallel", False):
            return tensor
        group = self._etp if entry.owner is not None else self._tp
        if is_gloo(group):  # see core.gloo
            mine = dist.get_rank(group)
            shards = [tensor.contiguous() if i == mine else torch.empty_like(tensor) for i in range(size)]
            all_gather_by_broadcasts(shards, group)
        else:
            shards = [torch.empty_like(tensor) for _ in range(size)]
            dist.all_gather(shards, tensor.contiguous(), group=group)
        return unshard(shards, *entry.partition)

    def local_shards(self, names: Sequence[str]) -> dict[str, LocalShard]:
        """This rank's part of each HF tensor of `names` that `shards.place` describes (the
        rest is gathered)."""
        if self._placed is None:
            self._placed = self._placements()
        out: dict[str, LocalShard] = {}
        for name in names:
            if name in self._placed:
                entry, placed = self._placed[name]
                out[name] = LocalShard(placed.ranges, placed.values(entry.tensor.detach()))
        return out

    def _placements(self) -> dict[str, tuple[_Entry, Placed]]:
        """Per describable HF tensor, its entry and what this rank claims of it: an expert only
        on its EP rank's ranks, any part by one of the ranks holding it alike (`shards.claims`)."""
        import torch.distributed as dist

        rows = {s.name: s.shape[0] if s.shape else 0 for s in self._specs}
        out: dict[str, tuple[_Entry, Placed]] = {}
        for index, entry in enumerate(self._entries):
            sharding, (tp, replicas) = Sharding(), self._grids[entry.owner is not None]
            if getattr(entry.tensor, "tensor_model_parallel", False) and dist.get_world_size(tp) > 1:
                sharding = Sharding(*entry.partition, dist.get_world_size(tp), dist.get_rank(tp))
            kept = [rows[n] for n in entry.hf]
            placed = place(tuple(entry.tensor.shape), sharding, entry.rule.split, self._heads, kept)
            if placed is None:
                continue
            mine = entry.owner in (None, self._ep_rank) and claims(
                index, sharding.size > 1, dist.get_rank(tp), dist.get_world_size(tp),
                dist.get_rank(replicas), dist.get_world_size(replicas),
            )
            out.update((name, (entry, p if mine else Placed.nothing())) for name, p in zip(entry.hf, placed))
        return out

    def _share_experts(self, names: list[str], out: dict[str, torch.Tensor]) -> None:
        """Every EP rank broadcasts the experts it holds, one flat tensor per dtype."""
        import torch
        import torch.distributed as dist

        specs = {s.name: s for s in self._specs if s.name in set(names)}
        for owner, src in enumerate(self._ep_ranks):
            owned = [n for n in names if self._by_hf[n].owner == owner]
            for dtype in sorted({specs[n].dtype for n in owned}):
                part = [n for n in owned if specs[n].dtype == dtype]
                if owner == self._ep_rank:
                    flat = torch.cat([out[n].reshape(-1) for n in part])
                else:
                    flat = torch.empty(sum(numel(specs[n].shape) for n in part), dtype=getattr(torch, dtype))
                dist.broadcast(flat, src=src, group=self._ep)
                if owner != self._ep_rank:
                    offset = 0
                    for n in part:
                        size = numel(specs[n].shape)
                        out[n] = flat[offset : offset + size].view(specs[n].shape)
                        offset += size


@dataclass(frozen=True)
class _Tensor:
    param: torch.Tensor


class _Buffer(_Tensor):
    """A buffer: mapped when the table names it (a router's expert bias), else skipped."""


def _tensors(chunks: list[Any]) -> Iterator[tuple[int, str, _Tensor]]:
    """(chunk index, name, tensor) of every parameter, then every buffer, of each chunk."""
    for c, chunk in enumerate(chunks):
        params = ((c, n, _Tensor(p)) for n, p in chunk.named_parameters())
        buffers = ((c, n, _Buffer(b)) for n, b in chunk.named_buffers())
        yield from chain(params, buffers)


def _names(rule: Rule, layer: int | None, expert: int | None) -> tuple[str, ...]:
    return tuple(t.format(layer=layer, expert=expert) for t in rule.hf)

