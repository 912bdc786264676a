"""A compiled layout read back (`stored`, from a layout cache directory) checked against the
engine's own loader, as a fresh compile checks its own, before it is trusted.

An entry can be well-formed and still wrong: two copy blocks swapped, a block a row off, a
region past its parameter, or what another build of an engine adapter compiled under the same
key. An update's digest check cannot see that (the sender and the engine follow the same
layout), so the layout is checked where it is read:

- every group: its parameters are the rank model's, each in one group (or left alone where the
  loader leaves it), in slots placed as a compile places them; it reads HF tensors of the
  trainer; its regions and blocks stay inside their parameter and HF tensor;
- HF tensors no group reads feed no parameter (the loader traced on meta);
- per structure (`structures`), the instances a compile checks (first, second, last) are
  checked again: the loader traced on meta on the group's inputs feeds exactly its parameters;
  a group compiled from that trace has the trace's copies and passes the compile's check
  (`checked_group`); a probed group's regions are the bytes the loader writes on random
  inputs, and its blocks write those bytes with the loader's values. Every other instance is
  the first renamed, as a compile makes it where the sampled ones are; else it is checked too.

A fused parameter of many experts is checked as a compile checks it: its copies equal the
trace's for every expert, the loader runs on a sample of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from ..core.layout import Layout
from ..core.types import ParamSpec, TargetTable, numel
from .copymap import Block, replay
from .layout import (
    EngineLayout, _Group, _random_inputs, _renamed_group, _viewer, check_params, checked_group, slots_of,
    written_regions,
)
from .probe import written_bytes
from .quantized import QuantizedLayout
from .quantizers import FP8_DTYPE, for_engine
from .rank_model import ParameterHolders, RankModel
from .structures import by_structure, names_between, sampled_instances, structure_key
from .target import RankModelTarget
from .trace import trace_loader


class UnverifiedLayout(ValueError):
    """A layout read back that is not what the engine's own loader makes of its inputs."""


def verify(layout: Layout, table: TargetTable, sources: Mapping[str, ParamSpec], target: RankModelTarget) -> None:
    """Raise UnverifiedLayout, saying what is wrong, unless `layout` (read back for `table`'s
    unit, from the trainer's HF tensors `sources`) is what `target` compiles."""
    rank_model = target.rank_model(table)
    quantization = target.quantization(table)
    if isinstance(layout, QuantizedLayout) and quantization is not None:
        quantizer = for_engine(quantization.config, target.options.quantizer)
        if (layout.quantizer, layout.dtype) != (quantizer, getattr(torch, quantization.dtype)):
            raise UnverifiedLayout(
                f"it quantizes with {layout.quantizer.name!r} to {layout.dtype}, not {quantizer.name!r}"
            )
        _Check(layout.inner, layout.checkpoint_specs(sources), rank_model).run()
        _check_quantized(layout, rank_model)
    elif isinstance(layout, EngineLayout) and quantization is None:
        _Check(layout, sources, rank_model).run()
    else:
        not_ = "not " * (quantization is None)
        raise UnverifiedLayout(f"a {type(layout).__name__} for an engine rank {not_}quantized")


def _check_quantized(layout: QuantizedLayout, rank_model: RankModel) -> None:
    """The HF tensors it quantizes are those its groups of fp8 parameters read (scales aside)."""
    params = dict(rank_model.model.named_parameters())
    scales = {layout.quantizer.scale_name(name) for name in layout.quantized}
    fp8 = {
        name for g in layout.inner.groups() if any(params[p].dtype == FP8_DTYPE for p in g.outputs)
        for name in g.inputs if name not in scales
    }
    if fp8 != layout.quantized:
        raise UnverifiedLayout(f"it quantizes {sorted(layout.quantized ^ fp8)[0]!r} wrongly")


class _Check:
    """The checks of one `EngineLayout` against `rank_model` (see the module)."""

    def __init__(self, layout: EngineLayout, sources: Mapping[str, ParamSpec], rank_model: RankModel) -> None:
        self.layout, self.sources, self.rank_model = layout, sources, rank_model
        self.holders = ParameterHolders(rank_model.model)
        self.groups = layout.compiled_groups()

    def run(self) -> None:
        check_params(self.layout.table, self.holders.params)
        self._params_once()
        for g in self.groups:
            self._in_bounds(g)
        self._unread_feed_nothing()
        self._per_structure()

    def _unread_feed_nothing(self) -> None:
        """HF tensors no group reads feed no parameter (else the engine would keep old bytes there)."""
        read = {name for g in self.groups for name in g.group.inputs}
        unread = [spec for name, spec in sorted(self.sources.items()) if name not in read]
        fed = trace_loader(self.rank_model.load, self.holders.params, unread).feeds if unread else {}
        if fed:
            name = sorted(fed)[0]
            raise UnverifiedLayout(f"no group reads HF tensor {sorted(fed[name])[0]!r}, which feeds {name!r}")

    def _per_structure(self) -> None:
        """The instances a compile checks against the loader checked so; the others the first renamed."""
        instances = [(g.group.inputs, g.group.outputs) for g in self.groups]
        for members in by_structure(instances, lambda i: structure_key(i, self.sources, self.holders.params)):
            checked, first = sampled_instances(members), members[0]
            renamed = {
                i: _renamed_group(self.groups[first], names_between(instances[first], instances[i])) for i in members
            }
            shares = len(members) > len(checked) and all(self.groups[i] == renamed[i] for i in checked[1:])
            for i in members:
                if i in checked or not shares:
                    self._like_the_loader(self.groups[i])
                elif self.groups[i] != renamed[i]:
                    name = self.groups[i].group.outputs[0]
                    raise UnverifiedLayout(f"{name!r} is not compiled as its structure's first instance")

    def _params_once(self) -> None:
        """Each parameter in one group or left alone (where the loader leaves it)."""
        outputs = [name for g in self.groups for name in g.group.outputs]
        left_alone = self.layout.left_alone()
        counts = Counter([*outputs, *left_alone])
        wrong = [n for n in self.holders.params if counts[n] != 1] + [n for n in counts if n not in self.holders.params]
        if wrong:
            raise UnverifiedLayout(f"parameter {wrong[0]!r} is in {counts[wrong[0]]} groups (or left alone)")
        unloaded = self.rank_model.unloaded_params()
        if any(name not in unloaded for name in left_alone):
            raise UnverifiedLayout(f"it leaves {next(n for n in left_alone if n not in unloaded)!r} alone")

    def _in_bounds(self, g: _Group) -> None:
        """`g`'s slots as a compile places them, its inputs HF tensors, its regions and blocks
        inside their parameter and HF tensor."""
        slots, nbytes = slots_of(self.holders.params, g.group.outputs)
        if [p.slot for p in g.params] != slots or g.group.nbytes != nbytes:
            raise UnverifiedLayout(f"{g.group.outputs[0]!r}: its slots are not where a compile puts them")
        unknown = [name for name in g.group.inputs if name not in self.sources]
        if unknown or len(set(g.group.inputs)) != len(g.group.inputs):
            raise UnverifiedLayout(f"{g.group.outputs[0]!r} reads {(unknown or ['an HF tensor twice'])[0]!r}")
        for p in g.params:
            slot = p.slot
            for r in p.regions:
                inside = r.param == slot.name and 0 <= r.param_offset and 0 < r.nbytes <= slot.nbytes - r.param_offset
                if not inside or r.buffer_offset != slot.offset + r.param_offset:
                    raise UnverifiedLayout(
                        f"{slot.name!r}: a region of {r.nbytes} bytes at {r.param_offset} is outside its "
                        f"{slot.nbytes} bytes"
                    )
            for b in p.blocks or ():
                read = b.source is None or (
                    b.source in g.group.inputs
                    and _inside(b.sizes, b.src_offset, b.src_strides, numel(self.sources[b.source].shape))
                )
                if not read or not _inside(b.sizes, b.dst_offset, b.dst_strides, numel(slot.shape)):
                    raise UnverifiedLayout(f"{slot.name!r}: a block reads or writes outside its tensors ({b})")

    def _like_the_loader(self, g: _Group) -> None:
        """`g` as a compile of its group would make it, checked as that compile checks it."""
        inputs = [self.sources[name] for name in g.group.inputs]
        trace = trace_loader(self.rank_model.load, self.holders.params, inputs)
        if set(trace.feeds) != set(g.group.outputs):
            raise UnverifiedLayout(
                f"{g.group.outputs[0]!r}: its HF tensors feed {sorted(trace.feeds)}, not its parameters "
                f"{sorted(g.group.outputs)}"
            )
        slots = [p.slot for p in g.params]
        if g.traced:
            blocks = [p.blocks or [] for p in g.params]
            traced = all(Counter(b) == Counter(trace.copies.get(p.slot.name) or ()) for b, p in zip(blocks, g.params))
            if not traced or g != checked_group(
                self.layout.table, self.rank_model, self.holders, trace.mutated, g.group, slots, inputs, blocks
            ):
                raise UnverifiedLayout(f"{g.group.outputs[0]!r}: its copies do not write what the loader writes")
            return
        random = _random_inputs(inputs, g.group.outputs[0])
        reference, written = written_bytes(
            self.rank_model.load, self.holders, _viewer(slots), random, g.group.nbytes, trace.mutated,
        )
        flat = {name: t.contiguous().view(-1) for name, t in random}
        for p in g.params:
            part = slice(p.slot.offset, p.slot.offset + p.slot.nbytes)
            if p.regions != written_regions(p.slot, written[part]) or (
                p.blocks is not None and not _writes(p.blocks, flat, p.slot.dtype, reference[part], written[part])
            ):
                raise UnverifiedLayout(f"{p.slot.name!r}: it does not write what the loader writes")


def _writes(blocks: Sequence[Block], flat: Mapping[str, torch.Tensor], dtype: torch.dtype,
            reference: torch.Tensor, written: torch.Tensor) -> bool:
    """Whether `blocks` write exactly the `written` bytes, with the values of `reference`."""
    for pattern in (0x00, 0xFF):
        out = torch.full_like(reference, pattern)
        replay(blocks, flat, out.view(dtype))
        if not torch.equal(out, torch.where(written, reference, out.new_tensor(pattern))):
            return False
    return True


def _inside(sizes: Sequence[int], offset: int, strides: Sequence[int], n: int) -> bool:
    """Whether the strided view (`sizes`, `strides` from `offset`) lies within `n` elements."""
    if len(strides) != len(sizes) or offset < 0 or any(s < 0 for s in (*sizes, *strides)):
        return False
    return 0 in sizes or offset + sum((size - 1) * stride for size, stride in zip(sizes, strides)) < n
