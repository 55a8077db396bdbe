"""megatron-core's openai_gelu against megatron-lite's, and megatron-core's GPTModel with activation_func=openai_gelu
against megatron-lite's GPTModel with activation_func='openai_gelu' on the same weights (megatron_lm.state_to_megatron).
Prints {"activation": max |diff| over x in [-12, 12] and 10^5 normal samples x 3, "largest": max |openai_gelu(x)|,
"logits": max |diff|, "logits_exact_gelu": max |diff| against megatron-lite with the exact GELU (how far another
activation lands), "largest_logit": max |logit|, "fused_logits" / "fused_logits_exact_gelu": the same for
megatron-core's GPTModel with F.gelu and bias_activation_fusion=True (Megatron-LM's default flags)} as JSON."""

import json

import torch


def main():
    import mcore_reference
    from megatron.core.transformer.utils import openai_gelu

    from megatron_lite.checkpointing import megatron_lm
    from megatron_lite.models import GPTConfig, GPTModel
    from megatron_lite.models.gpt import openai_gelu as lite_openai_gelu

    mcore_reference.init_world()
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-12, 12, 200001), torch.randn(100000, generator=generator) * 3])
    theirs = openai_gelu(x)
    results = {"activation": (lite_openai_gelu(x) - theirs).abs().max().item(), "largest": theirs.abs().max().item()}

    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16,
                       activation_func="openai_gelu")
    lite = GPTModel(config).eval()
    with torch.no_grad():  # weights of std 0.05, biases and norms near 1: the two GELUs differ by ~1e-4 there
        for p in lite.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    core = mcore_reference.build_gpt(config).eval()
    assert core.decoder.layers[0].mlp.config.activation_func is openai_gelu
    mapped = megatron_lm.state_to_megatron(lite.state_dict(), config.num_attention_heads, config.num_query_groups)
    loaded = core.load_state_dict(mapped, strict=False)
    assert not loaded.unexpected_keys and all(k.endswith("_extra_state") for k in loaded.missing_keys), loaded
    exact = GPTModel(GPTConfig(**{**config.__dict__, "activation_func": "gelu"})).eval()
    exact.load_state_dict(lite.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=generator)
    with torch.no_grad():
        expected, core_logits = lite(ids), mcore_reference.forward(core, ids)
        results.update(logits=(core_logits - expected).abs().max().item(),
                       logits_exact_gelu=(core_logits - exact(ids)).abs().max().item(),
                       largest_logit=expected.abs().max().item())
    # What Megatron-LM's core GPT computes by default: activation_func F.gelu with bias_activation_fusion
    # (core_transformer_config_from_args: args.bias_gelu_fusion, on unless --no-bias-gelu-fusion or
    # --disable-bias-linear), i.e. megatron-core's bias_gelu_impl, whatever --openai-gelu says.
    exact_config = GPTConfig(**{**config.__dict__, "activation_func": "gelu"})
    fused = mcore_reference.build_gpt(exact_config, bias_activation_fusion=True).eval()
    assert fused.decoder.layers[0].mlp.config.activation_func is torch.nn.functional.gelu
    fused.load_state_dict(mapped, strict=False)
    with torch.no_grad():
        fused_logits = mcore_reference.forward(fused, ids)
        results.update(fused_logits=(fused_logits - expected).abs().max().item(),
                       fused_logits_exact_gelu=(fused_logits - exact(ids)).abs().max().item())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
