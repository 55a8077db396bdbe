"""megatron-lite's GPTModel parameters <-> megatron-core's GPTModel parameters (names and layouts, in memory).

Names: megatron-core nests the embeddings under `embedding.` and the layers and the final norm under `decoder.`;
the rest matches (megatron-lite's names follow megatron-core's local layer spec):

    megatron-lite                                 megatron-core (GPTModel.state_dict())
    word_embeddings.weight                        embedding.word_embeddings.weight
    position_embeddings.weight                    embedding.position_embeddings.weight
    layers.{i}.<rest>                             decoder.layers.{i}.<rest>
    final_layernorm.{weight,bias}                 decoder.final_layernorm.{weight,bias}
    output_layer.weight (untied only)             output_layer.weight

Megatron-LM's default Transformer Engine layer spec fuses the pre-attention and pre-MLP norms into the next
linear layer: `self_attention.linear_qkv.layer_norm_{weight,bias}` and `mlp.linear_fc1.layer_norm_{weight,bias}`
stand for `input_layernorm.*` and `pre_mlp_layernorm.*` (TE_NORM_NAMES).

The fused QKV weight (and bias) is the one layout that differs. megatron-lite keeps the three blocks contiguous,
megatron-core interleaves them per query group (its SelfAttention splits each group's rows as [q; k; v]):

    megatron-lite   [q_0 .. q_{H-1} | k_0 .. k_{G-1} | v_0 .. v_{G-1}]       (each q_j, k_g, v_g: head_dim rows)
    megatron-core   [q_0 .. q_{H/G-1}, k_0, v_0 | ... | q_{H-H/G} .. q_{H-1}, k_{G-1}, v_{G-1}]

Query head j reads key/value group j // (H / G) in both. Copying the rows as they are loads without any missing or
unexpected key and computes garbage: qkv_to_megatron / qkv_from_megatron regroup them.
"""

import os
from typing import Dict, List

import torch

TE_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
"""Transformer Engine's fused-norm parameter names (per layer) -> the local spec's (megatron-lite's)."""

LEGACY_FILENAME = os.path.join("mp_rank_00", "model_optim_rng.pt")
"""Megatron-LM's legacy `torch` checkpoint file inside iter_XXXXXXX/ (one tensor- and pipeline-parallel rank)."""

LAYER_STATE_DICT_ORDER = {
    "local": ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_proj.weight",
              "self_attention.linear_proj.bias", "self_attention.linear_proj._extra_state",
              "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
              "self_attention.linear_qkv._extra_state", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
              "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc1._extra_state",
              "mlp.linear_fc2.weight", "mlp.linear_fc2.bias", "mlp.linear_fc2._extra_state"),
    "transformer_engine": ("self_attention.core_attention._extra_state", "self_attention.linear_proj.weight",
                           "self_attention.linear_proj.bias", "self_attention.linear_proj._extra_state",
                           "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
                           "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                           "self_attention.linear_qkv._extra_state", "mlp.linear_fc1.layer_norm_weight",
                           "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                           "mlp.linear_fc1._extra_state", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
                           "mlp.linear_fc2._extra_state"),
}
"""megatron-core GPTModel.state_dict()'s keys of one layer, in order (module registration order, each module's
weight, bias, then `_extra_state`), per --transformer-impl: the local spec's norms are modules of their own;
Transformer Engine's sit inside linear_qkv / linear_fc1 before their weight, and its core_attention has an
`_extra_state`. The legacy optimizer numbers the parameters in this order (megatron_read), the legacy export
writes it (megatron_write)."""


def state_dict_order(layers: int, transformer_impl: str) -> List[str]:
    """megatron-core GPTModel.state_dict() keys in order: embeddings, LAYER_STATE_DICT_ORDER per layer, the final
    norm, the output layer. Parameters and `_extra_state` entries a model does not have are the caller's to
    leave out."""
    return ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
            *[f"decoder.layers.{i}.{rest}" for i in range(layers) for rest in LAYER_STATE_DICT_ORDER[transformer_impl]],
            "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight",
            "output_layer._extra_state"]


def _qkv_blocks(tensor: torch.Tensor, num_heads: int, num_groups: int):
    rows = tensor.shape[0]
    head_dim = rows // (num_heads + 2 * num_groups)
    if head_dim * (num_heads + 2 * num_groups) != rows or num_heads % num_groups:
        raise ValueError(f"linear_qkv of {rows} rows does not hold {num_heads} query heads and {num_groups} "
                         f"key/value groups of equal head dim: the checkpoint's num_attention_heads / "
                         f"num_query_groups differ from the model's")
    return head_dim, num_heads // num_groups


def qkv_to_megatron(tensor: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """megatron-lite's linear_qkv weight [rows, h] or bias [rows] -> megatron-core's row order (a new tensor)."""
    head_dim, per_group = _qkv_blocks(tensor, num_heads, num_groups)
    rest = tensor.shape[1:]
    q, k, v = tensor.split([num_heads * head_dim, num_groups * head_dim, num_groups * head_dim])
    grouped = torch.cat([q.reshape(num_groups, per_group * head_dim, *rest), k.reshape(num_groups, head_dim, *rest),
                         v.reshape(num_groups, head_dim, *rest)], dim=1)
    return grouped.reshape(tensor.shape).contiguous()


def qkv_from_megatron(tensor: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """megatron-core's linear_qkv weight or bias -> megatron-lite's row order (a new tensor)."""
    head_dim, per_group = _qkv_blocks(tensor, num_heads, num_groups)
    rest = tensor.shape[1:]
    grouped = tensor.reshape(num_groups, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]).contiguous()


def name_to_megatron(name: str) -> str:
    """A megatron-lite parameter name -> megatron-core's (local layer spec)."""
    if name.startswith(("word_embeddings.", "position_embeddings.")):
        return "embedding." + name
    if name.startswith(("layers.", "final_layernorm.")):
        return "decoder." + name
    return name


def name_from_megatron(name: str) -> str:
    """A megatron-core parameter name (local or Transformer Engine spec) -> megatron-lite's."""
    for prefix in ("embedding.", "decoder."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        name = f"layers.{index}.{TE_NORM_NAMES.get(rest, rest)}"
    return name


def is_qkv(name: str) -> bool:
    """Whether a (megatron-lite or megatron-core) name is a fused QKV weight or bias."""
    return name.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"))


def state_to_megatron(state: Dict[str, torch.Tensor], num_heads: int, num_groups: int) -> Dict[str, torch.Tensor]:
    """A megatron-lite model state dict -> megatron-core's (names, QKV rows regrouped). Works on any per-parameter
    tensors of the parameters' shapes (Adam's moments too)."""
    return {name_to_megatron(k): (qkv_to_megatron(v, num_heads, num_groups) if is_qkv(k) else v)
            for k, v in state.items()}


def state_from_megatron(state: Dict[str, torch.Tensor], num_heads: int, num_groups: int) -> Dict[str, torch.Tensor]:
    """megatron-core's model state dict (local or TE names; `_extra_state` entries dropped) -> megatron-lite's."""
    return {name_from_megatron(k): (qkv_from_megatron(v, num_heads, num_groups) if is_qkv(k) else v)
            for k, v in state.items() if not k.endswith("_extra_state")}
