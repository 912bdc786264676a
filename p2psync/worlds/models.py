"""The tiny models every world runs: transformers causal LMs made from a config (no download),
trained on random tokens, and their greedy continuation of one fixed prompt."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

#: Transformers class prefix per architecture.
CLASSES = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}

#: The worlds' default model: a Qwen3 whose vocabulary is no multiple of 64, so that engines
#: which pad the vocabulary per rank (vLLM, sglang) leave regions their loader never writes.
TINY_QWEN3: dict[str, Any] = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
)
PROMPT = [1, 17, 42, 99, 7, 3]


@dataclass(frozen=True)
class ModelSpec:
    """An architecture (a key of CLASSES) and the keyword arguments of its transformers config."""

    arch: str = "qwen3"
    config: dict[str, Any] = field(default_factory=lambda: dict(TINY_QWEN3))

    def hf_config(self) -> Any:
        """The transformers config, naming its causal-LM class in `architectures` (engines read it)."""
        import transformers

        config = getattr(transformers, f"{CLASSES[self.arch]}Config")(
            **self.config, max_position_embeddings=256, initializer_range=0.05
        )
        config.architectures = [f"{CLASSES[self.arch]}ForCausalLM"]
        return config

    def config_dict(self) -> dict[str, Any]:
        """The HF config as a checkpoint's config.json holds it."""
        return json.loads(self.hf_config().to_json_string(use_diff=False))

    def build(self, seed: int) -> Any:
        """A randomly initialized float32 model (eager attention, eval mode). Norms start at 1 and
        a router's score bias at 0 in transformers: they are perturbed too, so that no tensor
        holds a value a wrong copy could also produce."""
        import torch
        import transformers

        torch.manual_seed(seed)
        config = self.hf_config()
        config._attn_implementation = "eager"
        model = getattr(transformers, f"{CLASSES[self.arch]}ForCausalLM")(config).eval()
        with torch.no_grad():
            for name, t in chain(model.named_parameters(), model.named_buffers()):
                if "norm" in name or name.endswith("e_score_correction_bias"):
                    t.add_(torch.randn_like(t) * 0.1)
        return model


def greedy(model: Any, tokens: int = 8) -> list[int]:
    """Greedy continuation of `PROMPT` (collective where the model is sharded)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([PROMPT], device=next(model.parameters()).device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )
    return out[0, len(PROMPT):].tolist()


def greedy_gaps(model: Any, tokens: Sequence[int], prompt: Sequence[int] = PROMPT) -> list[float]:
    """How far each of `tokens`, continuing `prompt`, falls below the best logit under `model`,
    teacher-forced on `tokens` (all 0 for the model's own greedy continuation). An engine that
    computes in bfloat16 may take the other of two near-tied tokens and go on from there; small
    gaps tell that apart from tokens another model chose."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([[*prompt, *tokens]], device=next(model.parameters()).device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, ids[0, len(prompt):, None])[:, 0]
    return (logits.max(dim=1).values - chosen).tolist()


class Trainer:
    """AdamW on random token batches for a causal LM (the same batches on every rank that
    passes the same `seed`)."""

    def __init__(self, model: Any, seed: int, lr: float = 1e-2) -> None:
        import torch

        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        import torch

        self.model.train()
        device = next(self.model.parameters()).device
        batch = torch.randint(0, self.model.config.vocab_size, (2, 16), generator=self.generator).to(device)
        self.model(input_ids=batch, labels=batch).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.model.eval()
