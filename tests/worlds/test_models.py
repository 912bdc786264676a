"""The worlds' model helpers: greedy gaps, which tests use to tell a bfloat16 engine's greedy
tokens from another model's."""

from __future__ import annotations

import torch

from p2psync.worlds import PROMPT, ModelSpec, greedy, greedy_gaps


def test_greedy_gaps_are_zero_on_the_models_own_continuation_and_large_on_another_models():
    model, other = ModelSpec().build(seed=1), ModelSpec().build(seed=2)
    own = greedy(model, 12)
    assert greedy_gaps(model, own) == [0.0] * 12
    theirs = greedy(other, 12)
    gaps = greedy_gaps(model, theirs)
    with torch.no_grad():  # each gap by hand: a forward over the prompt and the tokens before it
        for i, token in enumerate(theirs):
            logits = model(input_ids=torch.tensor([[*PROMPT, *theirs[:i]]])).logits[0, -1]
            assert abs(gaps[i] - (logits.max() - logits[token]).item()) < 1e-4
    assert sum(g > 0.05 for g in gaps) > 6, gaps
