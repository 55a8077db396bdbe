"""megatron-lite's GPTModel mapped onto megatron-core's (megatron_lm.state_to_megatron) computes the same logits:
for each architecture, megatron-lite's initial weights (norms and biases perturbed), loaded into megatron-core's
GPTModel strictly (only `_extra_state` may be missing), logits of both; also with the QKV rows copied as they are.
Prints {architecture: {"regrouped": max |diff|, "copied": max |diff|, "back_equal": bool, "largest": max |logit|}}
as JSON."""

import json

import torch

ARCHITECTURES = {
    "gpt2": dict(),
    "gpt2-heads8-groups2": dict(num_attention_heads=8, num_query_groups=2),
    "llama-gqa-untied": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func="silu",
                             num_query_groups=2, add_bias_linear=False, position_embedding_type="rope",
                             share_embeddings_and_output_weights=False, rotary_base=500000.0),
}


def main():
    import mcore_reference

    from megatron_lite.checkpointing import megatron_lm
    from megatron_lite.models import GPTConfig, GPTModel

    mcore_reference.init_world()
    results = {}
    for name, overrides in ARCHITECTURES.items():
        config = GPTConfig(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
                                     max_position_embeddings=16), **overrides})
        lite = GPTModel(config).eval()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param_name, p in lite.named_parameters():  # norms and biases away from 1 and 0: a swap shows
                if p.dim() == 1:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1 + (1.0 if "norm" in param_name else 0.0))
        core = mcore_reference.build_gpt(config).eval()
        heads, groups = config.num_attention_heads, config.num_query_groups
        result = core.load_state_dict(megatron_lm.state_to_megatron(lite.state_dict(), heads, groups), strict=False)
        assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys), result
        ids = torch.randint(0, config.vocab_size, (2, 12), generator=generator)
        with torch.no_grad():
            expected = lite(ids)
            regrouped = (mcore_reference.forward(core, ids) - expected).abs().max().item()
            back = megatron_lm.state_from_megatron(core.state_dict(), heads, groups)
            back_equal = back.keys() == lite.state_dict().keys() and all(
                torch.equal(back[k], v) for k, v in lite.state_dict().items())
            copied = {megatron_lm.name_to_megatron(k): v for k, v in lite.state_dict().items()}
            core.load_state_dict(copied, strict=False)
            copied_diff = (mcore_reference.forward(core, ids) - expected).abs().max().item()
        results[name] = {"regrouped": regrouped, "copied": copied_diff, "back_equal": back_equal,
                         "largest": expected.abs().max().item()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
