"""Tiny randomly initialised causal LMs of several families with a small byte-level BPE tokenizer and a
ChatML template, written to a directory exactly like a Hugging Face model. Built in about a second.
FAMILIES: llama, qwen2, qwen3 (q/k norms), mistral, mistral-sliding (a sliding window shorter than the
tests' conversations), gemma2 and gemma3 (sliding and global layers alternating, soft-capped logits, their
own query scaling), phi3 (fused qkv and gate/up projections)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen3Config)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, how are you today?",
    "Rome was not built in a day. Tell me about the history of Greece and its city-states.",
    "My locker code is 4512. Remember it please. What is the capital of France? Paris.",
    "user assistant system: numbers 0123456789 and punctuation !?.,;:'\"()[]{}-_ é ü 日本",
]
SLIDING_WINDOW = 48  # tokens: the tests' conversations run past it
_ALTERNATING = {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": SLIDING_WINDOW}
# family -> (config class, what it sets besides the shared shape)
FAMILIES = {
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 16}),
    "mistral": (MistralConfig, {}),
    "mistral-sliding": (MistralConfig, {"sliding_window": SLIDING_WINDOW}),
    "gemma2": (Gemma2Config, {"head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
                              "final_logit_softcapping": 30.0, **_ALTERNATING}),
    "gemma3": (Gemma3TextConfig, {"head_dim": 16, "query_pre_attn_scalar": 16, **_ALTERNATING}),
    "phi3": (Phi3Config, {}),
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    return tokenizer


SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 1024}


def make_tiny_model_dir(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """`overrides`: config fields set over the shape and the family's (num_hidden_layers, layer_types,
    sliding_window, ...)."""
    tokenizer = build_tokenizer()
    config_class, own = FAMILIES[family]
    config = config_class(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,  # large enough that small KV errors change greedy tokens
        **(SHAPE | own | overrides),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
