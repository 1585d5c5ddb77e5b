"""Tiny HuggingFace models and tokenizers built in code (no downloads)."""

from __future__ import annotations

import torch


def llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def llama(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides))


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
