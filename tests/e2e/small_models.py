"""Small random decoders the GPU tests build in place (no files travel to a GPU box): Qwen2, and a Llama shaped
like SmolLM2 (grouped-query attention, tied embeddings). Used by test_prompt_sharing_gpu.py and
test_packing_gpu.py."""
from __future__ import annotations

import torch

VOCAB = 96


def qwen2(attn: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=128, vocab_size=VOCAB, attn_implementation=attn))


def llama_tied(attn: str):
    """SmolLM2's shape in small: Llama, 3 query heads per key/value head, tied input/output embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                        intermediate_size=192, vocab_size=VOCAB, tie_word_embeddings=True,
                                        rope_theta=100000.0, attn_implementation=attn))
