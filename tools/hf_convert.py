"""Hugging Face transformers <-> megatron-lite: the config and the weights, mapped in memory (torch only).

checkpoint_convert.py beside it reads and writes the files (safetensors, config.json, tokenizer); this module
decides what goes where. It lives with its one user, above the library: it maps pretrain_gpt.py's flags
(megatron_lite.training's gpt_config_from_args, vocab_size_with_padding) to and from transformers' configs.
Two transformers classes express the two families of GPTModel:

    megatron-lite (args)                         GPT2LMHeadModel              LlamaForCausalLM
    learned positions, LayerNorm, GELU, biases   yes (activation 'gelu':
    multi-head, not gated                         exact erf; --openai-gelu:
                                                  'gelu_new', the tanh form)
    rope, RMSNorm, gated MLP, any query groups                                yes (biases all or none)

    megatron-lite parameter                      GPT2 (Conv1D: [in, out])     Llama (Linear: [out, in])
    word_embeddings.weight [V_pad, h]            transformer.wte [V, h]       model.embed_tokens [V, h]
    position_embeddings.weight                   transformer.wpe              -
    layers.i.input_layernorm                     transformer.h.i.ln_1         model.layers.i.input_layernorm
    layers.i.self_attention.linear_qkv           .attn.c_attn (transposed)    .self_attn.q_proj|k_proj|v_proj
        rows [q (heads x d) | k (groups x d) | v (groups x d)]: query head j reads group j // (heads / groups)
        in both libraries (repeat_kv), so the three blocks are split off as they are
    layers.i.self_attention.linear_proj          .attn.c_proj (transposed)    .self_attn.o_proj
    layers.i.pre_mlp_layernorm                   .ln_2                        .post_attention_layernorm
    layers.i.mlp.linear_fc1  rows [gate | up]    .mlp.c_fc (transposed)       .mlp.gate_proj | .mlp.up_proj
    layers.i.mlp.linear_fc2                      .mlp.c_proj (transposed)     .mlp.down_proj
    final_layernorm                              transformer.ln_f             model.norm
    output_layer.weight (untied only)            lm_head                      lm_head

Rotary positions need no permutation: GPTModel rotates the pairs (i, i + d/2) with the frequencies repeated
over both halves (megatron-core's non-interleaved layout), which is transformers' `rotate_half` exactly.
The activation: transformers names GELU's tanh approximation five ways ('gelu_new', GPT-2's, and
TANH_GELU's others); all compute Megatron's openai_gelu formula, within fp32 rounding (test_openai_gelu.py
measures each), and import as --openai-gelu; the export writes 'gelu_new'.
The vocabulary: megatron-lite pads the embedding rows to a multiple of 128 (padded_vocab_size); the export
keeps the tokenizer's rows only, the import pads with zero rows (logit 0 for ids no tokenizer produces).

`args` below is the dict a checkpoint records (save.checkpoint_args): the architecture flags of
pretrain_gpt.py by their argparse names; keys missing from older checkpoints take the flags' defaults.
"""

import argparse
import math
from typing import Dict, List, Tuple

import torch

from megatron_lite.models import GPTConfig, GPTModel
from megatron_lite.training.arguments import gpt_config_from_args
from megatron_lite.training.initialize import vocab_size_with_padding

GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"

# pretrain_gpt.py's defaults of the architecture flags, for checkpoints saved before a flag existed.
_DEFAULTS = dict(ffn_hidden_size=None, position_embedding_type="learned_absolute", normalization="LayerNorm",
                 untie_embeddings_and_output_weights=False, swiglu=False, group_query_attention=False,
                 num_query_groups=None, disable_bias_linear=False, norm_epsilon=1e-5, rotary_base=10000.0,
                 init_method_std=0.02, hidden_dropout=0.0, attention_dropout=0.0, openai_gelu=False)
# transformers' names of GELU's tanh approximation 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), each the
# formula of Megatron's openai_gelu (GPTConfig.activation_func 'openai_gelu'), evaluated in another order.
TANH_GELU = ("gelu_new", "gelu_fast", "gelu_accurate", "gelu_pytorch_tanh", "gelu_python_tanh")
# GPTConfig.activation_func -> transformers' name, for the export.
_HF_ACTIVATION = {"gelu": "gelu", "openai_gelu": "gelu_new", "silu": "silu"}


def _with_defaults(args: dict) -> dict:
    return {**_DEFAULTS, **{k: v for k, v in args.items() if v is not None}}


def gpt_config(args: dict) -> GPTConfig:
    """The GPTConfig of a checkpoint's recorded architecture: pretrain_gpt.py's mapping of the flags
    (gpt_config_from_args), with fp32 parameters."""
    a = _with_defaults(args)
    a.update(rotary_base=float(a["rotary_base"]), norm_epsilon=float(a["norm_epsilon"]), fp16=False, bf16=False)
    return gpt_config_from_args(argparse.Namespace(**a), vocab_size=a["padded_vocab_size"])


def architecture(config: GPTConfig) -> str:
    """GPT2 or LLAMA for this model. Raises ValueError naming the options neither class expresses."""
    gpt2 = {"--position-embedding-type rope": config.position_embedding_type != "learned",
            "--normalization RMSNorm": config.normalization != "LayerNorm",
            "--swiglu": config.gated_linear_unit,
            "--group-query-attention": config.num_query_groups != config.num_attention_heads,
            "--disable-bias-linear": not config.add_bias_linear}
    llama = {"--position-embedding-type rope": config.position_embedding_type != "rope",
             "--normalization RMSNorm": config.normalization != "RMSNorm",
             "--swiglu": not config.gated_linear_unit}
    if not any(gpt2.values()) and config.activation_func in ("gelu", "openai_gelu"):
        return GPT2
    if not any(llama.values()):
        return LLAMA
    used = [flag for flag, differs in gpt2.items() if differs] or ["a gated GELU MLP"]
    lacking = [flag for flag, differs in llama.items() if differs]
    raise ValueError(f"this model cannot be exported: transformers' GPT2LMHeadModel has learned positions, "
                     f"LayerNorm, a GELU MLP, multi-head attention and biases (the model has {', '.join(used)}), "
                     f"LlamaForCausalLM has rope, RMSNorm and a gated MLP (the model lacks {', '.join(lacking)})")


# ------------------------------------------------------------------------------------------ export
def to_hf(model_state: Dict[str, torch.Tensor], args: dict, vocab_size: int, eod: int) -> Tuple[dict, dict]:
    """A megatron-lite model's weights as a transformers model.

    Args:
        model_state: the checkpoint's 'model' (full tensors).
        args: the checkpoint's recorded arguments.
        vocab_size: the tokenizer's vocabulary (rows kept of the padded embedding); eod: its end-of-document id.
    Returns:
        (config.json's content, {transformers parameter name: tensor}); the tensors are contiguous copies in
        the model's dtype (config.json's `dtype`).
    """
    config = gpt_config(args)
    if not 0 < vocab_size <= config.vocab_size or not 0 <= eod < vocab_size:
        raise ValueError(f"vocabulary {vocab_size} (end-of-document id {eod}) does not fit the checkpoint's padded "
                         f"vocabulary {config.vocab_size}: was it trained with another --tokenizer-type?")
    kind = architecture(config)
    hf_config = _gpt2_config(config, vocab_size) if kind == GPT2 else _llama_config(config, vocab_size)
    dtype = model_state["word_embeddings.weight"].dtype  # the model's (bf16 in a --bf16 run), kept as it is
    hf_config.update(architectures=[kind], bos_token_id=eod, eos_token_id=eod, dtype=str(dtype).split(".")[-1],
                     initializer_range=config.init_method_std)
    names = _gpt2_names if kind == GPT2 else _llama_names
    tensors = {}
    for name, tensor in model_state.items():
        if name in ("word_embeddings.weight", "output_layer.weight"):
            tensor = tensor[:vocab_size]
        for hf_name, part in names(name, tensor, config):
            tensors[hf_name] = part.clone(memory_format=torch.contiguous_format)  # one copy, even of a transpose
    return hf_config, tensors


def _gpt2_config(config: GPTConfig, vocab_size: int) -> dict:
    return dict(model_type="gpt2", vocab_size=vocab_size, n_positions=config.max_position_embeddings,
                n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_attention_heads,
                n_inner=config.ffn_hidden_size, activation_function=_HF_ACTIVATION[config.activation_func],
                layer_norm_epsilon=config.layernorm_epsilon, resid_pdrop=config.hidden_dropout,
                embd_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                tie_word_embeddings=config.share_embeddings_and_output_weights)


def _llama_config(config: GPTConfig, vocab_size: int) -> dict:
    return dict(model_type="llama", vocab_size=vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
                head_dim=config.hidden_size // config.num_attention_heads,
                hidden_act=_HF_ACTIVATION[config.activation_func],
                max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
                rope_theta=config.rotary_base,  # transformers < 5; 5 reads rope_parameters
                rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base}, rope_scaling=None,
                attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear,
                attention_dropout=config.attention_dropout, pretraining_tp=1,
                tie_word_embeddings=config.share_embeddings_and_output_weights)


# GPT-2's linear layers are Conv1D modules: their weights are stored [in, out], the transpose of GPTModel's.
_GPT2_CONV1D = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def _gpt2_transposed(name: str) -> bool:
    """Whether transformers' GPT-2 holds the megatron-lite parameter `name` transposed (both directions)."""
    parts = name.split(".")
    return parts[0] == "layers" and parts[-1] == "weight" and ".".join(parts[2:-1]) in _GPT2_CONV1D


def _gpt2_names(name: str, tensor: torch.Tensor, config: GPTConfig) -> List[Tuple[str, torch.Tensor]]:
    top = {"word_embeddings.weight": "transformer.wte.weight", "position_embeddings.weight": "transformer.wpe.weight",
           "final_layernorm.weight": "transformer.ln_f.weight", "final_layernorm.bias": "transformer.ln_f.bias",
           "output_layer.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], tensor)]
    _, i, module, *rest = name.split(".")
    hf = {"input_layernorm": "ln_1", "pre_mlp_layernorm": "ln_2", "self_attention.linear_qkv": "attn.c_attn",
          "self_attention.linear_proj": "attn.c_proj", "mlp.linear_fc1": "mlp.c_fc", "mlp.linear_fc2": "mlp.c_proj"}
    key = ".".join([module, *rest[:-1]])
    return [(f"transformer.h.{i}.{hf[key]}.{rest[-1]}", tensor.t() if _gpt2_transposed(name) else tensor)]


def _llama_names(name: str, tensor: torch.Tensor, config: GPTConfig) -> List[Tuple[str, torch.Tensor]]:
    top = {"word_embeddings.weight": "model.embed_tokens.weight", "final_layernorm.weight": "model.norm.weight",
           "output_layer.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], tensor)]
    _, i, module, *rest = name.split(".")
    prefix, kind, suffix = f"model.layers.{i}", ".".join([module, *rest[:-1]]), rest[-1]
    if kind == "self_attention.linear_qkv":
        kv = config.num_query_groups * (config.hidden_size // config.num_attention_heads)
        q, k, v = tensor.split([config.hidden_size, kv, kv], dim=0)
        return [(f"{prefix}.self_attn.{p}_proj.{suffix}", t) for p, t in zip("qkv", (q, k, v))]
    if kind == "mlp.linear_fc1":
        gate, up = tensor.chunk(2, dim=0)
        return [(f"{prefix}.mlp.gate_proj.{suffix}", gate), (f"{prefix}.mlp.up_proj.{suffix}", up)]
    hf = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
          "self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj"}
    return [(f"{prefix}.{hf[kind]}.{suffix}", tensor)]


# ------------------------------------------------------------------------------------------ import
def from_hf(hf_config: dict, tensors: Dict[str, torch.Tensor]) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """A transformers GPT2LMHeadModel or LlamaForCausalLM as megatron-lite weights.

    Args:
        hf_config: config.json's content; tensors: every tensor of its safetensors files.
    Returns:
        (the architecture arguments a checkpoint records, the model's state dict with the vocabulary padded
        to a multiple of 128 by zero rows).
    Raises:
        ValueError naming the config field GPTModel cannot express, or a tensor missing / left over.
    """
    model_type, args, model_shapes, expected = _plan(hf_config, {k: tuple(v.shape) for k, v in tensors.items()})
    vocab_size = hf_config["vocab_size"]
    parts: Dict[str, list] = {}
    for hf_name, (name, part, _) in expected.items():
        if not tensors[hf_name].is_floating_point():
            raise ValueError(f"{hf_name} is {tensors[hf_name].dtype}, not floating point: not a weight to import")
        parts.setdefault(name, []).append((part, tensors[hf_name]))
    state = {}
    for name, pieces in parts.items():
        pieces = [t for _, t in sorted(pieces, key=lambda p: p[0])]
        transposed = model_type == "gpt2" and _gpt2_transposed(name)
        tensor = pieces[0].t() if transposed else torch.cat(pieces, dim=0)  # Conv1D weights: transposed back
        if name in ("word_embeddings.weight", "output_layer.weight"):  # the padding rows: zeros
            tensor = torch.cat([tensor, tensor.new_zeros(model_shapes[name][0] - vocab_size, tensor.shape[1])])
        state[name] = tensor.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # one copy
    return args, state


def imported_names(hf_config: dict, shapes: Dict[str, Tuple[int, ...]]) -> List[str]:
    """The transformers tensors from_hf reads, after config.json is compared with the names and shapes of the
    tensors present (the safetensors headers: call it before any tensor's data is read).

    Raises:
        ValueError as from_hf does, for config fields or names and shapes.
    """
    return sorted(_plan(hf_config, shapes)[3])


# Where transformers numbers the layers: the layer count of config.json is checked against the tensors
# present before a model of that many layers is built (an absurd count must not build layer after layer).
_LAYER_PREFIX = {"gpt2": ("transformer.h.", "n_layer"), "llama": ("model.layers.", "num_hidden_layers")}


def _plan(hf_config: dict, present: Dict[str, Tuple[int, ...]]):
    """config.json against the tensors present (name -> shape): (model_type, the recorded arguments,
    {megatron-lite name: padded shape}, {transformers name: (megatron-lite name, part, shape)})."""
    model_type = hf_config.get("model_type")
    if model_type == "gpt2":
        args, names = _args_from_gpt2(hf_config), _gpt2_names
    elif model_type == "llama":
        args, names = _args_from_llama(hf_config), _llama_names
    else:
        raise ValueError(f"config.json: model_type {model_type!r} cannot be imported: only 'gpt2' "
                         f"(GPT2LMHeadModel) and 'llama' (LlamaForCausalLM)")
    prefix, field = _LAYER_PREFIX[model_type]
    layers = {name[len(prefix):].split(".", 1)[0] for name in present if name.startswith(prefix)}
    if len(layers) != args["num_layers"] or layers != {str(i) for i in range(args["num_layers"])}:
        held = sorted(layers, key=lambda i: (len(i), i))
        named = f" ({prefix}{{{', '.join(held[:3])}{', ...' if len(held) > 3 else ''}}})" if held else ""
        raise ValueError(f"the weights do not match config.json: {field}={args['num_layers']}, the tensors hold "
                         f"{len(layers)} layers{named}")
    vocab_size = _positive_int(hf_config, "vocab_size")
    args["padded_vocab_size"] = vocab_size_with_padding(vocab_size)
    config = gpt_config(args)
    # Recorded as pretrain_gpt.py records a flag left out (None), where the value is the flag's default: a
    # --finetune run need not give it (a checkpoint's None is not compared; the shapes still are).
    if config.ffn_hidden_size == gpt_config({**args, "ffn_hidden_size": None}).ffn_hidden_size:
        args["ffn_hidden_size"] = None
    if args["num_query_groups"] == 1:  # Megatron's default with --group-query-attention
        args["num_query_groups"] = None
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPTModel(config).state_dict().items()}
    expected = {}  # transformers name -> (megatron-lite name, index of the part, the part's shape)
    for name, shape in shapes.items():
        rows = vocab_size if name in ("word_embeddings.weight", "output_layer.weight") else shape[0]
        meta = torch.empty((rows, *shape[1:]), device="meta")
        for part, (hf_name, piece) in enumerate(names(name, meta, config)):
            expected[hf_name] = (name, part, tuple(piece.shape))
    tied_head = "lm_head.weight" in present and config.share_embeddings_and_output_weights
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected) - ({"lm_head.weight"} if tied_head else set()))
    unexpected = [k for k in unexpected if not k.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))]
    if missing or unexpected:
        raise ValueError(f"the weights do not match config.json: missing {missing[:4]}, unexpected {unexpected[:4]}")
    for hf_name, (_, _, shape) in expected.items():
        if tuple(present[hf_name]) != shape:
            raise ValueError(f"the weights do not match config.json: {hf_name} has shape "
                             f"{list(present[hf_name])}, the config makes {list(shape)}")
    return model_type, args, shapes, expected


def _positive_int(hf_config: dict, key: str, default=None) -> int:
    value = _field(hf_config, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {key}={value!r} must be a positive integer")
    return value


def _field(hf_config: dict, key: str, default=None):
    value = hf_config.get(key, default)
    if value is None:
        raise ValueError(f"config.json lacks {key!r}")
    return value


def _refuse(hf_config: dict, checks: Dict[str, tuple]):
    """checks: field -> (allowed values, why). Raises ValueError naming the first field with another value."""
    for key, (allowed, why) in checks.items():
        if key in hf_config and hf_config[key] not in allowed:
            raise ValueError(f"config.json: {key}={hf_config[key]!r} cannot be imported: {why}")


def _args_from_gpt2(c: dict) -> dict:
    _refuse(c, {"activation_function": (("gelu", *TANH_GELU), "GPTModel's GELU is the exact erf form, "
                                        "transformers' 'gelu', or its tanh approximation (--openai-gelu), "
                                        f"transformers' {', '.join(map(repr, TANH_GELU))}"),
                "scale_attn_weights": ((True,), "GPTModel scales attention scores by 1/sqrt(head_dim)"),
                "scale_attn_by_inverse_layer_idx": ((False,), "GPTModel has no per-layer attention scaling"),
                "add_cross_attention": ((False,), "GPTModel is decoder-only")})
    h, heads = _positive_int(c, "n_embd"), _positive_int(c, "n_head")
    return dict(num_layers=_positive_int(c, "n_layer"), hidden_size=h, num_attention_heads=heads,
                ffn_hidden_size=_positive_int(c, "n_inner") if c.get("n_inner") else 4 * h,
                max_position_embeddings=_positive_int(c, "n_positions"),
                position_embedding_type="learned_absolute", normalization="LayerNorm",
                untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True), swiglu=False,
                group_query_attention=False, num_query_groups=None, disable_bias_linear=False,
                norm_epsilon=float(c.get("layer_norm_epsilon", 1e-5)), rotary_base=10000.0,
                openai_gelu=c.get("activation_function", "gelu_new") in TANH_GELU)


def _args_from_llama(c: dict) -> dict:
    rope = c.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _refuse(c, {"hidden_act": (("silu",), "GPTModel's gated MLP is SwiGLU (--swiglu)"),
                "rope_scaling": ((None,), "GPTModel's rotary embedding has no scaling (use the unscaled model)"),
                "pretraining_tp": ((1,), "a tensor-parallel split of the weights at pretraining; set it to 1")})
    if rope_type != "default":
        raise ValueError(f"config.json: rope_parameters.rope_type={rope_type!r} cannot be imported: GPTModel's "
                         f"rotary embedding is the default (unscaled) one")
    if c.get("attention_bias", False) != c.get("mlp_bias", False):
        raise ValueError(f"config.json: attention_bias={c.get('attention_bias')} with mlp_bias={c.get('mlp_bias')} "
                         f"cannot be imported: GPTModel has biases in every linear layer or in none "
                         f"(--disable-bias-linear)")
    h, heads = _positive_int(c, "hidden_size"), _positive_int(c, "num_attention_heads")
    if c.get("head_dim") not in (None, h // heads) or h % heads:
        raise ValueError(f"config.json: head_dim={c.get('head_dim')} cannot be imported: GPTModel's head dim is "
                         f"hidden_size / num_attention_heads = {h / heads:g}")
    groups = _positive_int(c, "num_key_value_heads") if c.get("num_key_value_heads") else heads
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    if not 0 < theta < math.inf:
        raise ValueError(f"config.json: rope_theta={theta!r} must be a finite number > 0")
    return dict(num_layers=_positive_int(c, "num_hidden_layers"), hidden_size=h, num_attention_heads=heads,
                ffn_hidden_size=_positive_int(c, "intermediate_size"),
                max_position_embeddings=_positive_int(c, "max_position_embeddings"), position_embedding_type="rope",
                normalization="RMSNorm", untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
                swiglu=True, group_query_attention=groups != heads,
                num_query_groups=groups if groups != heads else None,
                disable_bias_linear=not c.get("attention_bias", False),
                norm_epsilon=float(c.get("rms_norm_eps", 1e-6)), rotary_base=float(theta), openai_gelu=False)


def pretrain_flags(args: dict) -> List[str]:
    """The architecture flags of pretrain_gpt.py that build this model (give them with --finetune --load)."""
    a = _with_defaults(args)
    config = gpt_config(args)
    flags = ["--num-layers", a["num_layers"], "--hidden-size", a["hidden_size"],
             "--num-attention-heads", a["num_attention_heads"], "--ffn-hidden-size", config.ffn_hidden_size,
             "--max-position-embeddings", a["max_position_embeddings"], "--norm-epsilon", a["norm_epsilon"],
             "--position-embedding-type", a["position_embedding_type"]]
    if a["position_embedding_type"] == "rope":
        flags += ["--rotary-base", a["rotary_base"]]
    if a["normalization"] != "LayerNorm":
        flags += ["--normalization", a["normalization"]]
    for flag, on in (("--swiglu", a["swiglu"]), ("--disable-bias-linear", a["disable_bias_linear"]),
                     ("--openai-gelu", a["openai_gelu"]),
                     ("--untie-embeddings-and-output-weights", a["untie_embeddings_and_output_weights"])):
        flags += [flag] if on else []
    if config.num_query_groups != config.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", config.num_query_groups]
    return [str(f) for f in flags]
