"""The library reference: the same weights loaded by `transformers`.

Two ways in, and the tests use both:
- `load_reference(name)` builds `LlamaForCausalLM` from our dequantized safetensors and
  config (fast: a second or two);
- `load_reference_from_gguf(name)` lets `transformers` read the GGUF itself
  (`gguf_file=`, ~25 s), an independent check of our dequantization and un-permutation.
"""

from __future__ import annotations

import torch

from labkit.models import registry
from labkit.models.gguf_file import LlamaConfig


def hf_config(config: LlamaConfig):
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        torch_dtype="float32",
    )


def load_reference(name: str = registry.DEFAULT_MODEL, attn_implementation: str = "sdpa"):
    """`transformers.LlamaForCausalLM` holding exactly the weights our model holds."""
    from transformers import LlamaForCausalLM

    from labkit.models.loader import load_state_dict

    state, config = load_state_dict(name)
    cfg = hf_config(config)
    cfg._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # rebuild off meta
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"reference model left weights unset: {missing[:5]}")
    return model.float().eval()


def load_reference_from_gguf(name: str = registry.DEFAULT_MODEL):
    """`transformers` reading the GGUF on its own (slow; an independent loader)."""
    from transformers import AutoModelForCausalLM

    path = registry.fetch(name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 torch_dtype=torch.float32)
    return model.eval()
