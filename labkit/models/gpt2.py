"""GPT-2's forward pass, written out by hand (chapter 4).

Everything a GPT-2 does to turn token ids into logits is in this file, with no
library model underneath: token + position embeddings, ``n_layer`` pre-LayerNorm
blocks (causal self-attention, then a GELU MLP, each added back to the residual
stream), a final LayerNorm and an LM head that reuses the token embedding.

The weights are plain parameters in the ``[out, in]`` layout that ``F.linear``
expects. Hugging Face's GPT-2 stores its projections in ``Conv1D`` modules as
``[in, out]``, so :meth:`GPT2.from_hf_state_dict` transposes them on the way in
and :func:`make_hf_reference` transposes them back.

The attention is the naive, readable version (full score matrix, no KV cache):
this file is for reading and for checking against ``transformers``, not speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024  # longest sequence the position table covers
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_inner(self) -> int:  # MLP hidden width
        return 4 * self.n_embd

    @classmethod
    def from_hf(cls, hf_config) -> "GPT2Config":
        """From a ``transformers.GPT2Config`` (or any object with the same fields)."""
        n_inner = getattr(hf_config, "n_inner", None)
        if n_inner is not None and n_inner != 4 * hf_config.n_embd:
            raise ValueError(f"n_inner={n_inner} is not supported (only 4 * n_embd)")
        act = getattr(hf_config, "activation_function", "gelu_new")
        if act != "gelu_new":
            raise ValueError(f"activation_function={act!r} is not supported (only 'gelu_new')")
        return cls(
            vocab_size=hf_config.vocab_size,
            n_positions=hf_config.n_positions,
            n_embd=hf_config.n_embd,
            n_layer=hf_config.n_layer,
            n_head=hf_config.n_head,
            layer_norm_epsilon=hf_config.layer_norm_epsilon,
        )


# --------------------------------------------------------------------------- #
# The three operations GPT-2 is built from
# --------------------------------------------------------------------------- #


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise each vector to mean 0, variance 1, then scale and shift."""
    mean = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: the activation GPT-2 was trained with ("gelu_new")."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) @ v, for q, k, v of shape [batch, heads, seq, d]."""
    seq, d = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # [batch, heads, seq, seq]
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))  # position i sees only 0..i
    return torch.softmax(scores, dim=-1) @ v


# --------------------------------------------------------------------------- #
# The model
# --------------------------------------------------------------------------- #


class Block(nn.Module):
    """One transformer layer's weights; linear weights are [out, in]."""

    def __init__(self, config: GPT2Config, **factory):
        super().__init__()
        E, H = config.n_embd, config.n_inner

        def p(*shape):
            return nn.Parameter(torch.empty(*shape, **factory))

        self.ln_1_weight, self.ln_1_bias = p(E), p(E)
        self.attn_qkv_weight, self.attn_qkv_bias = p(3 * E, E), p(3 * E)  # c_attn, fused q|k|v
        self.attn_proj_weight, self.attn_proj_bias = p(E, E), p(E)  # attn.c_proj
        self.ln_2_weight, self.ln_2_bias = p(E), p(E)
        self.mlp_fc_weight, self.mlp_fc_bias = p(H, E), p(H)  # mlp.c_fc
        self.mlp_proj_weight, self.mlp_proj_bias = p(E, H), p(E)  # mlp.c_proj


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config, *, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.config = config
        factory = {"dtype": dtype, "device": device}
        E = config.n_embd
        self.wte = nn.Parameter(torch.empty(config.vocab_size, E, **factory))  # also the LM head
        self.wpe = nn.Parameter(torch.empty(config.n_positions, E, **factory))
        self.layers = nn.ModuleList(Block(config, **factory) for _ in range(config.n_layer))
        self.ln_f_weight = nn.Parameter(torch.empty(E, **factory))
        self.ln_f_bias = nn.Parameter(torch.empty(E, **factory))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: LongTensor [batch, seq] -> logits [batch, seq, vocab]."""
        cfg = self.config
        B, T = input_ids.shape
        if T > cfg.n_positions:
            raise ValueError(f"sequence of {T} tokens is longer than n_positions={cfg.n_positions}")
        nh, hd, eps = cfg.n_head, cfg.head_dim, cfg.layer_norm_epsilon

        positions = torch.arange(T, device=input_ids.device)
        x = self.wte[input_ids] + self.wpe[positions]  # [B, T, E]: the residual stream

        for L in self.layers:
            # attention: every position reads from itself and the positions before it
            h = layer_norm(x, L.ln_1_weight, L.ln_1_bias, eps)
            q, k, v = F.linear(h, L.attn_qkv_weight, L.attn_qkv_bias).split(cfg.n_embd, dim=-1)
            q, k, v = (t.view(B, T, nh, hd).transpose(1, 2) for t in (q, k, v))  # [B, nh, T, hd]
            a = causal_self_attention(q, k, v).transpose(1, 2).reshape(B, T, cfg.n_embd)
            x = x + F.linear(a, L.attn_proj_weight, L.attn_proj_bias)

            # MLP: each position on its own, widen 4x, GELU, project back
            h = layer_norm(x, L.ln_2_weight, L.ln_2_bias, eps)
            h = gelu_new(F.linear(h, L.mlp_fc_weight, L.mlp_fc_bias))
            x = x + F.linear(h, L.mlp_proj_weight, L.mlp_proj_bias)

        x = layer_norm(x, self.ln_f_weight, self.ln_f_bias, eps)
        return F.linear(x, self.wte)  # tied LM head: logits = x @ wte^T

    def num_parameters(self) -> int:
        """Parameter count; the tied LM head is the token embedding, counted once."""
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ #
    # Weights
    # ------------------------------------------------------------------ #

    @classmethod
    def random(cls, config: GPT2Config, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> "GPT2":
        """Seeded random weights: N(0, 0.02) like GPT-2's init. LayerNorm weights are
        1 + noise and all biases small noise, so a check against a reference exercises them."""
        model = cls(config, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith("ln_") or ".ln_" in name:
                    mean = 1.0 if name.endswith("_weight") else 0.0  # LayerNorm gain ~1, shift ~0
                    p.normal_(mean, 0.1, generator=gen)
                else:  # embeddings, linear weights and biases
                    p.normal_(0.0, 0.02, generator=gen)
        return model.to(dtype)

    @classmethod
    def from_hf_state_dict(cls, state_dict: dict, config: GPT2Config, *, dtype: torch.dtype = torch.float32) -> "GPT2":
        """Load a ``transformers`` GPT2LMHeadModel (or GPT2Model) state dict.
        Conv1D weights are [in, out] there; they are transposed to [out, in] here."""
        sd = {k.removeprefix("transformer."): v for k, v in state_dict.items()}
        model = cls(config, dtype=dtype)

        def put(param: torch.Tensor, key: str, transpose: bool = False):
            t = sd[key].t() if transpose else sd[key]
            if t.shape != param.shape:
                raise ValueError(f"{key}: shape {tuple(t.shape)}, expected {tuple(param.shape)}")
            param.copy_(t)

        with torch.no_grad():
            put(model.wte, "wte.weight")
            put(model.wpe, "wpe.weight")
            for i, L in enumerate(model.layers):
                pre = f"h.{i}."
                put(L.ln_1_weight, pre + "ln_1.weight")
                put(L.ln_1_bias, pre + "ln_1.bias")
                put(L.attn_qkv_weight, pre + "attn.c_attn.weight", transpose=True)
                put(L.attn_qkv_bias, pre + "attn.c_attn.bias")
                put(L.attn_proj_weight, pre + "attn.c_proj.weight", transpose=True)
                put(L.attn_proj_bias, pre + "attn.c_proj.bias")
                put(L.ln_2_weight, pre + "ln_2.weight")
                put(L.ln_2_bias, pre + "ln_2.bias")
                put(L.mlp_fc_weight, pre + "mlp.c_fc.weight", transpose=True)
                put(L.mlp_fc_bias, pre + "mlp.c_fc.bias")
                put(L.mlp_proj_weight, pre + "mlp.c_proj.weight", transpose=True)
                put(L.mlp_proj_bias, pre + "mlp.c_proj.bias")
            put(model.ln_f_weight, "ln_f.weight")
            put(model.ln_f_bias, "ln_f.bias")
        if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"].to(dtype), model.wte):
            raise ValueError("lm_head.weight differs from wte.weight: untied heads are not supported")
        return model

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`from_hf_state_dict` (GPT2LMHeadModel key names)."""
        sd = {"transformer.wte.weight": self.wte, "transformer.wpe.weight": self.wpe}
        for i, L in enumerate(self.layers):
            pre = f"transformer.h.{i}."
            sd |= {
                pre + "ln_1.weight": L.ln_1_weight,
                pre + "ln_1.bias": L.ln_1_bias,
                pre + "attn.c_attn.weight": L.attn_qkv_weight.t(),
                pre + "attn.c_attn.bias": L.attn_qkv_bias,
                pre + "attn.c_proj.weight": L.attn_proj_weight.t(),
                pre + "attn.c_proj.bias": L.attn_proj_bias,
                pre + "ln_2.weight": L.ln_2_weight,
                pre + "ln_2.bias": L.ln_2_bias,
                pre + "mlp.c_fc.weight": L.mlp_fc_weight.t(),
                pre + "mlp.c_fc.bias": L.mlp_fc_bias,
                pre + "mlp.c_proj.weight": L.mlp_proj_weight.t(),
                pre + "mlp.c_proj.bias": L.mlp_proj_bias,
            }
        sd |= {
            "transformer.ln_f.weight": self.ln_f_weight,
            "transformer.ln_f.bias": self.ln_f_bias,
            "lm_head.weight": self.wte,
        }
        return {k: v.detach().contiguous() for k, v in sd.items()}


def make_hf_reference(model: GPT2):
    """The ``transformers`` GPT2LMHeadModel with the same weights (float32, eval, eager attention)."""
    import transformers

    cfg = model.config
    hf_config = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.n_positions,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        layer_norm_epsilon=cfg.layer_norm_epsilon,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )
    ref = transformers.GPT2LMHeadModel(hf_config)
    sd = {k: v.float() for k, v in model.to_hf_state_dict().items()}
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch: missing={missing} unexpected={unexpected}")
    ref.tie_weights()
    return ref.float().eval()
