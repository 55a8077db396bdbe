"""A GPT decoder (pre-norm, Megatron-style init) that knows nothing about distribution.

    input_ids [b, s] -> word (+ learned position) embeddings -> num_layers x TransformerLayer
        -> final_layernorm -> output projection (tied to the word embeddings by default) -> logits [b, s, V]

The defaults are GPT-2's shape (LayerNorm, GELU, multi-head attention, biases); the Llama-class options are
megatron.core's: normalization='RMSNorm', gated_linear_unit with activation_func='silu' (SwiGLU),
num_query_groups (grouped-query attention), add_bias_linear=False, position_embedding_type='rope'.

Parameter names follow megatron.core (`layers.0.self_attention.linear_qkv.weight`, ...). Data parallelism
wraps this module from the outside (DistributedDataParallel), so it imports torch only.
"""

import math
import types
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's openai_gelu (--openai-gelu; GPT-2's original, transformers' 'gelu_new'): GELU's tanh
    approximation 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). torch's fused kernel of the same formula:
    it differs from megatron-core's expression in the last bit only, and autograd keeps x alone."""
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "openai_gelu": openai_gelu}


@dataclass
class GPTConfig:
    """Model shape and initialization; validated on construction."""

    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Attention heads; must divide hidden_size."""
    vocab_size: int
    """Vocabulary size (rows of the word embedding, columns of the logits)."""
    max_position_embeddings: int
    """Longest sequence the model accepts (rows of the learned position embedding)."""
    ffn_hidden_size: Optional[int] = None
    """Width of the MLP's hidden layer; None means 4 * hidden_size, or with gated_linear_unit Megatron's
    --swiglu rule int(4 * hidden_size * 2 / 3 / 64) * 64 (about the same parameter count in three matrices)."""
    normalization: str = "LayerNorm"
    """'LayerNorm', or 'RMSNorm' (x / sqrt(mean(x^2) + eps) * weight: no mean subtraction, no bias)."""
    gated_linear_unit: bool = False
    """Gated MLP: linear_fc1 makes two halves and the MLP computes act(gate) * up (SwiGLU with
    activation_func='silu'; Megatron's --swiglu sets both)."""
    activation_func: str = "gelu"
    """The MLP's activation: 'gelu' (exact, erf), 'openai_gelu' (its tanh approximation, Megatron's
    --openai-gelu) or 'silu'."""
    num_query_groups: Optional[int] = None
    """Key/value heads of grouped-query attention: each serves num_attention_heads / num_query_groups query
    heads; None means num_attention_heads (multi-head attention)."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linear layers (Megatron's --disable-bias-linear turns them off)."""
    position_embedding_type: str = "learned"
    """'learned' (absolute, added to the word embeddings) or 'rope' (rotary, applied to q and k)."""
    rotary_base: float = 10000.0
    """Base of the rotary frequencies: theta_i = rotary_base^(-2i / head_dim)."""
    hidden_dropout: float = 0.0
    """Dropout on the embeddings and on each residual branch's output."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    init_method_std: float = 0.02
    """Std of the normal init of all weights; output projections use std / sqrt(2 * num_layers)."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    share_embeddings_and_output_weights: bool = True
    """The output projection reuses the word-embedding matrix (one Parameter, two uses)."""
    params_dtype: torch.dtype = torch.float32
    """dtype the parameters are created in."""

    def __post_init__(self):
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int) and self.hidden_size > 0:
            # Megatron's rule (arguments.py): a gated MLP has three matrices, so 2/3 of the width, rounded
            # down to a multiple of 64.
            self.ffn_hidden_size = (int((4 * self.hidden_size * 2 / 3) / 64) * 64 if self.gated_linear_unit is True
                                    else 4 * self.hidden_size)
            if self.ffn_hidden_size == 0:  # a non-positive hidden_size is named by the checks below
                raise ValueError(f"ffn_hidden_size: the gated_linear_unit default int(4 * hidden_size * 2 / 3 / 64)"
                                 f" * 64 is 0 for hidden_size {self.hidden_size}: give ffn_hidden_size")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        # The table below, in order: each named field's rule, or (None) a rule across fields. The same walk as
        # megatron_lite/config_checks.py, kept here because the model imports torch only.
        for names, holds, message in _CHECKS:
            for name in names or (None,):
                value = self if name is None else getattr(self, name)
                if not holds(value):
                    raise ValueError(message.format(name=name, value=value, config=self))


_CHECKS = (
    (("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings", "ffn_hidden_size",
      "num_query_groups"),
     lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
     "{name} must be a positive integer, got {value!r}"),
    ((), lambda c: not c.hidden_size % c.num_attention_heads,
     "hidden_size ({config.hidden_size}) must be divisible by num_attention_heads ({config.num_attention_heads})"),
    ((), lambda c: not c.num_attention_heads % c.num_query_groups,
     "num_attention_heads ({config.num_attention_heads}) must be divisible by num_query_groups "
     "({config.num_query_groups})"),
    (("normalization",), lambda v: v in ("LayerNorm", "RMSNorm"),
     "{name} must be 'LayerNorm' or 'RMSNorm', got {value!r}"),
    (("activation_func",), lambda v: v in _ACTIVATIONS,
     f"{{name}} must be one of {sorted(_ACTIVATIONS)}, got {{value!r}}"),
    (("gated_linear_unit", "add_bias_linear", "share_embeddings_and_output_weights"), lambda v: isinstance(v, bool),
     "{name} must be True or False, got {value!r}"),
    (("position_embedding_type",), lambda v: v in ("learned", "rope"),
     "{name} must be 'learned' or 'rope', got {value!r}"),
    ((), lambda c: c.position_embedding_type != "rope" or not (c.hidden_size // c.num_attention_heads) % 2,
     "position_embedding_type='rope' needs an even head dim (hidden_size / num_attention_heads)"),
    (("rotary_base", "init_method_std", "layernorm_epsilon"), lambda v: 0 < v < math.inf,
     "{name} must be a finite number > 0, got {value}"),
    (("hidden_dropout", "attention_dropout"), lambda v: 0.0 <= v < 1.0, "{name} must be in [0, 1), got {value}"),
    (("params_dtype",), lambda v: isinstance(v, torch.dtype) and v.is_floating_point,
     "{name} must be a floating-point torch.dtype, got {value!r}"),
)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), head_dim] (fp32) for rotating pairs (i, i + head_dim/2) by positions * theta_i."""
    # megatron-core's and transformers' expression: base ** (-x) rounds differently in the last bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = torch.outer(positions.float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # megatron.core's non-interleaved ("rotate half") layout
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., s, head_dim] in fp32; then q_m . k_n depends on positions only through m - n."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def norm(config: GPTConfig) -> nn.Module:
    """config.normalization over the hidden dimension; torch's RMSNorm adds eps inside the square root, as
    Megatron's does."""
    kind = nn.RMSNorm if config.normalization == "RMSNorm" else nn.LayerNorm
    return kind(config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)


class SelfAttention(nn.Module):
    """Causal self-attention; with num_query_groups < num_attention_heads, query head i reads key/value group
    i // (num_attention_heads / num_query_groups)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        h, dtype, bias = config.hidden_size, config.params_dtype, config.add_bias_linear
        self.num_heads, self.head_dim = config.num_attention_heads, h // config.num_attention_heads
        self.num_query_groups = config.num_query_groups
        self.dropout = config.attention_dropout
        # Fused [q (all heads) | k (all groups) | v (all groups)]; with as many groups as heads this is the
        # multi-head [3, heads, head_dim] layout.
        kv = self.num_query_groups * self.head_dim
        self.linear_qkv = nn.Linear(h, h + 2 * kv, bias=bias, dtype=dtype)
        self.linear_proj = nn.Linear(h, h, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, rotary: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        b, s, h = x.shape
        groups, d = self.num_query_groups, self.head_dim
        q, k, v = self.linear_qkv(x).split([h, groups * d, groups * d], dim=-1)
        q = q.view(b, s, self.num_heads, d).transpose(1, 2)  # [b, heads, s, head_dim]
        k, v = (t.view(b, s, groups, d).transpose(1, 2) for t in (k, v))  # [b, groups, s, head_dim]
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                             is_causal=True, enable_gqa=groups != self.num_heads)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    """fc2(act(fc1(x))), or gated: fc1 makes [gate | up] and the MLP computes fc2(act(gate) * up)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        dtype, bias, ffn = config.params_dtype, config.add_bias_linear, config.ffn_hidden_size
        self.gated = config.gated_linear_unit
        self.activation = _ACTIVATIONS[config.activation_func]
        self.linear_fc1 = nn.Linear(config.hidden_size, 2 * ffn if self.gated else ffn, bias=bias, dtype=dtype)
        self.linear_fc2 = nn.Linear(ffn, config.hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_fc1(x)
        if self.gated:
            gate, up = x.chunk(2, dim=-1)
            return self.linear_fc2(self.activation(gate) * up)
        return self.linear_fc2(self.activation(x))


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.input_layernorm = norm(config)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), rotary))
        return x + self.dropout(self.mlp(self.pre_mlp_layernorm(x)))


class GPTModel(nn.Module):
    """Decoder-only language model.

    Args:
        config: a GPTConfig.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        h, dtype = config.hidden_size, config.params_dtype
        self.word_embeddings = nn.Embedding(config.vocab_size, h, dtype=dtype)
        self.position_embeddings = None
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, h, dtype=dtype)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.final_layernorm = norm(config)
        # Tied: no second Parameter; forward uses word_embeddings.weight, so its grad sums both uses.
        self.output_layer = None
        if not config.share_embeddings_and_output_weights:
            self.output_layer = nn.Linear(h, config.vocab_size, bias=False, dtype=dtype)
        self._tag_matrices()
        self._init_weights()

    def __setstate__(self, state):
        # copy.deepcopy and pickle rebuild each Parameter without its attributes: tag the copy's again.
        super().__setstate__(state)
        self._tag_matrices()

    def _tag_matrices(self):
        """Mark what optimizers that treat each weight matrix as a whole (Muon) need to know: megatron-core's
        is_embedding_or_output_parameter on the word embeddings and the output layer (left to AdamW: a row is a
        token's vector, not a map), and each fused linear_qkv weight's matrix_row_splits, the row counts of its
        contiguous [Q; K; V] blocks."""
        for layer in (self.word_embeddings, self.output_layer):
            if layer is not None:
                layer.weight.is_embedding_or_output_parameter = True
        for layer in self.layers:
            attention = layer.self_attention
            kv = attention.num_query_groups * attention.head_dim
            attention.linear_qkv.weight.matrix_row_splits = (self.config.hidden_size, kv, kv)

    @torch.no_grad()
    def _init_weights(self):
        """Megatron's init: N(0, std) weights, N(0, std / sqrt(2L)) for the residual branches' output
        projections (keeps the residual stream's variance independent of depth), zero biases, unit norms."""
        std = self.config.init_method_std
        scaled_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                scaled = name.endswith("linear_proj") or name.endswith("linear_fc2")
                nn.init.normal_(module.weight, mean=0.0, std=scaled_std if scaled else std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [b, s, vocab] (params dtype), or with `labels` [b, s] per-token cross-entropy [b, s] in fp32."""
        s = input_ids.shape[1]
        if s > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {s} exceeds max_position_embeddings ({self.config.max_position_embeddings})")
        positions = torch.arange(s, device=input_ids.device)
        x = self.word_embeddings(input_ids)
        rotary = None
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions)
        else:
            rotary = rotary_cos_sin(positions, self.config.hidden_size // self.config.num_attention_heads,
                                    self.config.rotary_base)
        x = self.embedding_dropout(x)
        for layer in self.layers:
            x = layer(x, rotary)
        return self.output_head(x, labels)

    def output_head(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The final norm and the output layer: logits, or with `labels` the per-token loss (fp32)."""
        b, s, _ = x.shape
        x = self.final_layernorm(x)
        weight = self.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        logits = F.linear(x, weight)
        if labels is None:
            return logits
        # The loss in fp32 (a bf16 log-softmax over a large vocabulary loses most of its precision).
        losses = F.cross_entropy(logits.float().view(b * s, -1), labels.reshape(b * s), reduction="none")
        return losses.view(b, s)

    def compile_layers(self, **compile_kwargs) -> "GPTModel":
        """torch.compile each transformer layer's forward and the output head, one region each (torchtitan's
        per-block compile; `compile_kwargs` go to torch.compile). Module and parameter hooks stay outside the
        compiled code, so DistributedDataParallel's buckets still reduce while backward runs through the other
        layers and ZeRO-3 still gathers and frees a layer at a time. Call before or after wrapping; the
        parameters and the state_dict are unchanged. Numerics follow the compiled kernels' fusion (close to
        eager, not bitwise). Returns the model."""
        for layer in self.layers:
            layer.forward = _compiled_method(layer, "forward", compile_kwargs)
        self.output_head = _compiled_method(self, "output_head", compile_kwargs)
        return self

    def compile_forward(self, **compile_kwargs) -> "GPTModel":
        """torch.compile the whole forward as one region (`compile_kwargs` go to torch.compile): more fusion
        and fewer launches than compile_layers, but backward becomes one compiled node, so every parameter's
        gradient (and DistributedDataParallel's grad hooks, hence every bucket's reduction) arrives only when
        all of backward has run: no overlap. Hooks on the submodules run inside the compiled code, so a wrapper
        that releases parameters between layers cannot run it (the graph keeps a released parameter's storage):
        DistributedDataParallel refuses it under ZeRO-3, before or after wrapping (use compile_layers there).
        The parameters and the state_dict are unchanged; use it or compile_layers, not both.
        Returns the model."""
        self.forward = _compiled_method(self, "forward", compile_kwargs)
        return self


def _compiled_method(obj: nn.Module, name: str, compile_kwargs: dict) -> types.MethodType:
    """The class's method `name`, compiled, bound to `obj`: stored on the instance, a method object is rebound
    to the copy by copy.deepcopy (a compiled bound method would be shared, and the copy would run the
    original's parameters)."""
    return types.MethodType(torch.compile(getattr(type(obj), name), **compile_kwargs), obj)


def num_floating_point_operations(config: GPTConfig, batch_size: int, seq_length: int) -> float:
    """Model FLOPs of one training step (forward + backward) on batch_size x seq_length tokens.

    A matmul of [m, k] @ [k, n] costs 2mkn; backward costs twice forward (grads of inputs and weights):
        forward = 2 * T * L * (h * (h + 2 * kv) + h^2 + m * h * ffn)   # linear_qkv, linear_proj, MLP
                + L * 2 * 2 * b * s^2 * h              # q @ k^T and probs @ v (full square, as Megatron)
                + 2 * T * h * V                        # logits
        step    = 3 * forward,  T = b * s tokens
    kv = num_query_groups * head_dim (h without grouped-query attention); m = 3 matrices of h x ffn in a gated
    MLP (fc1's two halves and fc2), else 2, as Megatron's ffn_expansion_factor. Multi-head with ffn = 4h is
    Megatron's 72 * T * L * h^2 * (1 + s / (6h) + V / (12 L h)). Norms, softmax, activations and rotary are
    elementwise and left out (the convention MFU numbers are quoted with).
    """
    b, s, L, h = batch_size, seq_length, config.num_layers, config.hidden_size
    ffn = config.ffn_hidden_size  # GPTConfig.__post_init__ fills both in: never None here
    kv = config.num_query_groups * (h // config.num_attention_heads)
    mlp_matrices = 3 if config.gated_linear_unit else 2
    tokens = b * s
    forward = (2.0 * tokens * L * (h * (h + 2 * kv) + h * h + mlp_matrices * h * ffn)
               + L * 2.0 * 2.0 * b * s * s * h
               + 2.0 * tokens * h * config.vocab_size)
    return 3.0 * forward
