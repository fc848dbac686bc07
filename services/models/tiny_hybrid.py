"""A tiny random-weight Qwen3-Next checkpoint (3 Gated-DeltaNet layers + 1 full-attention layer).

Deterministic for a given seed: the same seed gives byte-identical weights. It carries a
byte-level tokenizer (256 byte tokens in a 1,024-token vocabulary) so it can be served
end to end through the router. Weights are drawn with ``initializer_range=0.2``, which gives
varied greedy tokens (vLLM's ``load_format="dummy"`` gives degenerate repeats).
"""
from __future__ import annotations

from pathlib import Path

from services.models.cache import prepare_generated

NAME = "tiny-qwen3-next"
VOCAB_SIZE = 1024
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def prepare(seed: int = 0, target: Path | None = None) -> Path:
    """Return the checkpoint directory for ``seed``, generating it on first use."""
    return prepare_generated(NAME, seed, target, _generate)


# What the tiny models share (tiny_dense too): sizes, heads, token ids, and the wide initialisation.
SHARED_CONFIG = {"vocab_size": VOCAB_SIZE, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 8192,
                 "initializer_range": 0.2, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
                 "pad_token_id": 0, "torch_dtype": "bfloat16"}


def config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **SHARED_CONFIG,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        full_attention_interval=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
    )


def _generate(seed: int, out: Path) -> None:
    import torch
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config()).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer().save_pretrained(out)


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(specials + byte_chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
