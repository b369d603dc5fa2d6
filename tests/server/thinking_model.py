"""A tiny Llama checkpoint, built by hand, that writes a fixed reasoning-model answer.

With SmolLM2's tokenizer and chat template, its one layer adds nothing to the residual stream
(``o_proj`` and ``down_proj`` are zero), so each next token depends only on the current one:
the embedding puts each token of ``CHAIN`` on a dimension of its own, and the head maps that
dimension to the chain's next token with a logit of 80 (every other token gets 0), so even
sampling at temperature 1 follows the chain. The chat prompt ends with a newline, and the
answer is ``REASONING + "</think>" + ANSWER`` and the end-of-turn token: DeepSeek-R1's shape,
whose template opens ``<think>`` in the prompt. Tokens off the chain (which only a grammar can
make it write) have no embedding, so after them every logit is 0.
"""

import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from strata.worker.model_loader import resolve_model_path

REASONING = " Let me see"
ANSWER = "Paris"
TEXT = f"{REASONING}</think>{ANSWER}"
NEXT_TOKEN_LOGIT = 80.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def save_thinking_model(path: Path) -> None:
    source = resolve_model_path(None)  # the default model's converted directory: its tokenizer
    tokenizer = AutoTokenizer.from_pretrained(source)
    newline = tokenizer.encode("\n")
    chain = newline + tokenizer.encode(TEXT) + [tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "a token twice in the chain would need two successors"
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # RMSNorm scales a one-hot row by sqrt(hidden_size) = 8: 8 * 10 = NEXT_TOKEN_LOGIT.
        for dimension, (token, following) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, dimension] = 1.0
            model.lm_head.weight[following, dimension] = NEXT_TOKEN_LOGIT / 8
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
