"""megatron_lite/checkpointing/megatron_lm.py: megatron-lite's GPTModel parameters <-> megatron-core's. The QKV
regrouping against an index formula written independently, round trips, names (local and Transformer Engine), and
megatron-core's own GPTModel computing megatron-lite's logits from the mapped weights (where megatron-core is
installed: `pip install -e ".[megatron]"`), which copying the QKV rows as they are does not."""

import pytest
import torch
from mcore_reference import requires_mcore, run_script

from megatron_lite.checkpointing import megatron_lm


def _megatron_row_order(num_heads, num_groups, head_dim):
    """Row r of megatron-core's fused QKV = row order[r] of megatron-lite's, from the two layouts' definitions."""
    per_group, kv = num_heads // num_groups, num_groups * head_dim
    order = []
    for g in range(num_groups):
        for j in range(g * per_group, (g + 1) * per_group):  # the group's query heads
            order += [j * head_dim + d for d in range(head_dim)]
        order += [num_heads * head_dim + g * head_dim + d for d in range(head_dim)]  # k_g
        order += [num_heads * head_dim + kv + g * head_dim + d for d in range(head_dim)]  # v_g
    return order


@pytest.mark.parametrize("heads,groups,head_dim", [(4, 4, 2), (8, 2, 3), (6, 1, 4), (2, 2, 1)])
def test_qkv_regrouping_matches_the_layouts(heads, groups, head_dim):
    rows = (heads + 2 * groups) * head_dim
    weight, bias = torch.randn(rows, 5), torch.randn(rows)
    order = _megatron_row_order(heads, groups, head_dim)
    assert torch.equal(megatron_lm.qkv_to_megatron(weight, heads, groups), weight[order])
    assert torch.equal(megatron_lm.qkv_to_megatron(bias, heads, groups), bias[order])
    for tensor in (weight, bias):
        there = megatron_lm.qkv_to_megatron(tensor, heads, groups)
        assert torch.equal(megatron_lm.qkv_from_megatron(there, heads, groups), tensor)


def test_qkv_rows_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="num_attention_heads / num_query_groups"):
        megatron_lm.qkv_to_megatron(torch.zeros(13, 4), 4, 2)
    with pytest.raises(ValueError, match="num_attention_heads / num_query_groups"):
        megatron_lm.qkv_from_megatron(torch.zeros(16, 4), 3, 2)  # 3 heads cannot share 2 groups


def test_names_both_ways():
    names = {"word_embeddings.weight": "embedding.word_embeddings.weight",
             "position_embeddings.weight": "embedding.position_embeddings.weight",
             "layers.3.self_attention.linear_qkv.weight": "decoder.layers.3.self_attention.linear_qkv.weight",
             "layers.0.mlp.linear_fc2.bias": "decoder.layers.0.mlp.linear_fc2.bias",
             "final_layernorm.weight": "decoder.final_layernorm.weight", "output_layer.weight": "output_layer.weight"}
    for lite, core in names.items():
        assert megatron_lm.name_to_megatron(lite) == core
        assert megatron_lm.name_from_megatron(core) == lite
    for te, local in megatron_lm.TE_NORM_NAMES.items():  # Transformer Engine's fused norms read as the local ones
        assert megatron_lm.name_from_megatron(f"decoder.layers.7.{te}") == f"layers.7.{local}"
    state = {"decoder.layers.0.self_attention.linear_proj._extra_state": None,
             "decoder.layers.0.self_attention.linear_proj.weight": torch.ones(2, 2)}
    assert list(megatron_lm.state_from_megatron(state, 1, 1)) == ["layers.0.self_attention.linear_proj.weight"]


@requires_mcore
def test_megatron_core_computes_the_same_logits():
    results = run_script("mcore_mapping_check.py")
    for name, result in results.items():
        assert result["regrouped"] < 1e-6, (name, result)
        assert result["back_equal"], name
        assert result["copied"] > 1e-2, (name, result)  # the silent trap: every key loads, the logits are wrong
