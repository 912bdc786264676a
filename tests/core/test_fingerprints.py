"""An engine rank's proof that it still holds what the last update left (`engine/fingerprints.py`).

The oracle is the bytes themselves: two tensors get one fingerprint exactly when their bytes
are equal (for the changes tried: every single changed byte, at block edges and in the tail)."""

from __future__ import annotations

import pytest
import torch

from p2psync.engine.fingerprints import BLOCK_BYTES, HeldWeights, fingerprint


@pytest.mark.parametrize("nbytes", [0, 1, 7, BLOCK_BYTES - 1, BLOCK_BYTES, 3 * BLOCK_BYTES + 5])
def test_every_changed_byte_changes_the_fingerprint(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    print_ = fingerprint(data)
    assert fingerprint(data.clone()) == print_
    for at in sorted({0, nbytes // 2, BLOCK_BYTES - 1, BLOCK_BYTES, nbytes - 1} & set(range(nbytes))):
        changed = data.clone()
        changed[at] ^= 0x01
        assert fingerprint(changed) != print_, at


def test_a_misaligned_view_prints_as_its_bytes():
    base = torch.randn(3 * BLOCK_BYTES // 4 + 3)
    view = base.view(torch.uint8)[3:]  # an offset no 64-bit word starts at
    assert fingerprint(view) == fingerprint(view.clone())
    assert fingerprint(base.to(torch.bfloat16)) != fingerprint(base)  # other bytes, other print


def test_held_weights_name_what_changed_since_the_last_update():
    params = {"a": torch.randn(5000), "b": torch.randn(7)}
    held = HeldWeights(params)
    assert held.altered() is None  # nothing fingerprinted yet: nothing to prove against
    held.finished("v1")
    assert held.altered() is None
    params["b"][3] += 1
    assert held.altered() == "1 parameter(s) changed since update 'v1' other than by p2psync: b"
    held.finished("v2")
    held.written("load_state_dict")
    assert held.altered() == "its weights were written outside p2psync (load_state_dict) after update 'v2'"
