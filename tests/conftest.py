"""Shared fixtures: the default model and its reference are loaded once per session."""

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))

PROMPTS = [
    "An inference engine takes a trained model and a request, and it must",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Les modèles de langage prédisent le prochain mot. 東京は日本の首都です。",
    "1, 2, 3, 5, 8, 13, 21,",
    "<|im_start|>user\nWrite a haiku about caches.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def model():
    from labkit.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def reference():
    from labkit.models.reference import load_reference

    return load_reference("smollm2-135m")


def make_tiny_llama(seed: int = 0, vocab: int = 97, hidden: int = 32, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, max_len: int = 512):
    """A randomly initialised Llama small enough for property tests (no tokenizer)."""
    import torch

    from labkit.models.gguf_file import LlamaConfig
    from labkit.models.llama import Llama

    head_dim = hidden // heads
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         rope_theta=10_000.0, rms_norm_eps=1e-5, max_position_embeddings=max_len)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=gen) * scale

    state = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
             "model.norm.weight": 1 + rand(hidden, scale=0.1)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = 1 + rand(hidden, scale=0.1)
        state[p + "post_attention_layernorm.weight"] = 1 + rand(hidden, scale=0.1)
        state[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        state[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        state[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        state[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        state[p + "mlp.gate_proj.weight"] = rand(2 * hidden, hidden)
        state[p + "mlp.up_proj.weight"] = rand(2 * hidden, hidden)
        state[p + "mlp.down_proj.weight"] = rand(hidden, 2 * hidden)
    return Llama(config, state)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()


def make_tiny_gemma3(seed: int = 0, layer_windows=(8, 8, None, 8, 8, None), max_len: int = 128):
    """A randomly initialised Gemma 3 with windowed and global layers (no tokenizer)."""
    from labkit.models.gemma3 import Gemma3, Gemma3Config

    c = Gemma3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=len(layer_windows),
                     num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=max_len,
                     layer_windows=layer_windows, local_rope_theta=10.0, global_rope_theta=100.0,
                     query_pre_attn_scalar=8.0)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=gen) * scale

    state = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size, scale=1.0),
             "model.norm.weight": rand(c.hidden_size, scale=0.1)}
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": rand(q, c.hidden_size),
                      p + "self_attn.k_proj.weight": rand(kv, c.hidden_size),
                      p + "self_attn.v_proj.weight": rand(kv, c.hidden_size),
                      p + "self_attn.o_proj.weight": rand(c.hidden_size, q),
                      p + "self_attn.q_norm.weight": rand(c.head_dim, scale=0.1),
                      p + "self_attn.k_norm.weight": rand(c.head_dim, scale=0.1),
                      p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
                      p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
                      p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size)})
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            state[p + norm + ".weight"] = rand(c.hidden_size, scale=0.1)
    return Gemma3(c, state)


@pytest.fixture(scope="session")
def tiny_gemma3():
    """Six layers, four with a window of 8 positions and two global."""
    return make_tiny_gemma3()


def masked_greedy(model, prompt, new_tokens):
    """Greedy tokens and their log-probabilities from a windowed model with the cache that
    keeps every position and applies each layer's window as a mask (`WindowedKVCache`)."""
    from labkit.models.window_cache import WindowedKVCache

    cache = WindowedKVCache.empty(model.config, 1, len(prompt) + new_tokens)
    logits = model(torch.tensor([prompt]), cache=cache, last_only=True)[0, -1]
    tokens, logprobs = [], []
    for _ in range(new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        logits = model(torch.tensor([[token]]), cache=cache, last_only=True)[0, -1]
    return tokens, logprobs


def random_qkv(batch, heads, kv_heads, steps, kv_len, dim=16, dtype=torch.float32, seed=0):
    """Seeded attention inputs: q [batch, heads, steps, dim], k and v [batch, kv_heads, kv_len, dim]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, steps, dim, generator=g).to(dtype),
            torch.randn(batch, kv_heads, kv_len, dim, generator=g).to(dtype),
            torch.randn(batch, kv_heads, kv_len, dim, generator=g).to(dtype))


def greedy_reference(model, ids, steps):
    """One sequence, contiguous cache, argmax at every step: the reference the engine's
    batched and speculative paths must reproduce token for token."""
    cache = model.new_cache(1, len(ids) + steps)
    logits = model(torch.tensor([ids]), cache=cache, last_only=True)[0, -1]
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([[out[-1]]]), cache=cache)[0, -1]
    return out


def hf_greedy(reference, prompt_ids, steps):
    """`transformers` greedy generate of at most `steps` tokens; a final EOS (id 2) is left
    out, since labkit reports it as the finish reason instead of a token."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=steps, do_sample=False,
                                 eos_token_id=2, pad_token_id=2)
    ids = out[0, len(prompt_ids):].tolist()
    return ids[:-1] if ids and ids[-1] == 2 else ids
