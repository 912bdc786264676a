"""A tiny random Qwen3 checkpoint and tokenizer, built locally (no downloads), and the trainer's weights per update.

float32, so that sglang's forward and transformers' agree to ~1e-6 and greedy decoding is a sharp oracle.
"""

from __future__ import annotations

import os

import torch

VOCAB = 300


def make_model(out: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = specials + [chr(c) for c in range(33, 127)] + ["user", "assistant", "system"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=vocab["<|im_end|>"], pad_token_id=0, bos_token_id=None,
                      dtype="float32")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).float()
    model.save_pretrained(out)  # one model.safetensors at this size
    fast.save_pretrained(out)
    return out


def base_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def trained_state_dict(model_dir: str, update: int) -> dict[str, torch.Tensor]:
    """What the stand-in trainer holds at its `update`-th update (1, 2, ...): the checkpoint the servers loaded
    plus noise drawn from `update`, so that every update changes every parameter."""
    g = torch.Generator().manual_seed(1000 + update)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)
            for k, v in sorted(base_state_dict(model_dir).items())}


def greedy(model_dir: str, state_dict: dict[str, torch.Tensor], prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` under `state_dict` (no EOS stop: sglang runs with ignore_eos)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out
