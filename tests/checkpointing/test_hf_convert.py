"""Hugging Face transformers export and import (tools/hf_convert.py, tools/checkpoint_convert.py
--to hf / --from hf): logits equal transformers' for GPT-2 and Llama styles, the round trip bitwise, --finetune from
an imported checkpoint on 2 gloo ranks, the tokenizer files, and the errors. Skipped without the optional extra
(transformers, safetensors, tokenizers: `pip install -e ".[hf]"`)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from distributed_helper import run_distributed
from pretrain_testing import REPO, pretrain_losses, tiny_pretrain_flags

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from megatron_lite.checkpointing import hf_files  # noqa: E402
from megatron_lite.data import build_tokenizer  # noqa: E402
from megatron_lite.models import GPTModel  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "tools"))
import checkpoint_convert  # noqa: E402
import hf_convert  # noqa: E402

TOOL = os.path.join(REPO, "tools", "checkpoint_convert.py")
SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=384, max_position_embeddings=24)
LLAMA = dict(SMALL, hidden_size=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             group_query_attention=True, num_query_groups=2, disable_bias_linear=True, ffn_hidden_size=96,
             untie_embeddings_and_output_weights=True, norm_epsilon=1e-6, rotary_base=500000.0)
ARCHITECTURES = {  # recorded checkpoint arguments -> the transformers class they export to
    "gpt2-tied": (SMALL, "GPT2LMHeadModel"),
    "gpt2-untied-eps": (dict(SMALL, untie_embeddings_and_output_weights=True, norm_epsilon=1e-3, ffn_hidden_size=48),
                        "GPT2LMHeadModel"),
    "llama-gqa-untied": (LLAMA, "LlamaForCausalLM"),
    "llama-mqa-tied-biases": (dict(LLAMA, num_query_groups=1, untie_embeddings_and_output_weights=False,
                                   disable_bias_linear=False, norm_epsilon=1e-5, rotary_base=10000.0),
                              "LlamaForCausalLM"),
    "llama-mha": (dict(LLAMA, group_query_attention=False, num_query_groups=None), "LlamaForCausalLM"),
}


def _model(args, seed=0):
    """The GPTModel of `args` with non-trivial values everywhere (norm weights and biases too), so a weight left
    out, transposed or swapped shows in the logits."""
    model = GPTModel(hf_convert.gpt_config(args))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def _export(model, args, out, vocab_size=300, tokenizer="NullTokenizer"):
    payload = {"model": model.state_dict(), "iteration": 0,
               "args": dict(args, tokenizer_type=tokenizer, vocab_size=vocab_size)}
    return checkpoint_convert.export_hf(payload, str(out))


def _tokens(vocab_size, seed=1, shape=(2, 24)):
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ export: logits
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_exported_model_gives_megatron_lite_logits_in_transformers(tmp_path, name):
    """GPT2LMHeadModel / LlamaForCausalLM loaded by from_pretrained from the exported directory give GPTModel's
    fp32 logits within 1e-5 (measured: 0.0, bitwise) on the tokenizer's vocabulary, with weights of std 0.3.
    Would catch a wrong activation (gelu_new is ~1e-3 off), eps or rope theta, q/k/v or gate/up swapped or
    transposed, key/value groups mapped to the wrong query heads, the rotary convention (interleaved vs
    rotate-half), an untied head exported as tied (or the reverse), or the padded rows kept."""
    args, kind = ARCHITECTURES[name]
    model = _model(args)
    config = _export(model, args, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == kind == config["architectures"][0]
    assert hf.config.vocab_size == 300 and hf.config.tie_word_embeddings == (
        not args.get("untie_embeddings_and_output_weights", False))
    tokens = _tokens(300)
    with torch.no_grad():
        ours, theirs = model(tokens)[..., :300], hf(tokens).logits
    assert theirs.shape == ours.shape
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_exported_config_fields(tmp_path):
    """config.json names every architecture field with the run's values, and the activation is the exact
    erf GELU ('gelu', not transformers' GPT-2 default 'gelu_new'). Would catch a field left at transformers'
    default (Llama's rms_norm_eps 1e-6 and bos 1 / eos 2, GPT-2's n_inner, rope theta 10000), or weights only
    their owner can read."""
    gpt2 = _export(_model(SMALL), dict(SMALL, norm_epsilon=1e-3), tmp_path / "gpt2", vocab_size=257)
    assert {k: gpt2[k] for k in ("n_layer", "n_embd", "n_head", "n_inner", "n_positions", "vocab_size",
                                 "activation_function", "layer_norm_epsilon", "tie_word_embeddings",
                                 "bos_token_id", "eos_token_id")} == dict(
        n_layer=2, n_embd=32, n_head=4, n_inner=128, n_positions=24, vocab_size=257, activation_function="gelu",
        layer_norm_epsilon=1e-3, tie_word_embeddings=True, bos_token_id=256, eos_token_id=256)
    llama = _export(_model(LLAMA), LLAMA, tmp_path / "llama")
    assert {k: llama[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                                  "attention_bias", "mlp_bias", "tie_word_embeddings", "max_position_embeddings",
                                  "eos_token_id")} == dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False, max_position_embeddings=24, eos_token_id=299)
    assert llama["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    loaded = transformers.AutoConfig.from_pretrained(str(tmp_path / "llama"))
    assert loaded.rope_parameters["rope_theta"] == 500000.0 and loaded.rms_norm_eps == 1e-6
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / "llama" / "model.safetensors").st_mode & 0o777 == 0o666 & ~umask  # not 0600


# ------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_round_trip_is_bitwise(name):
    """to_hf -> from_hf gives back every tensor bitwise and the same GPTConfig. Vocabulary 300 of 384: the
    300 rows bitwise, the padding rows zero. Would catch an asymmetric mapping (a transpose or a q/k/v split
    undone differently), a lost field (eps, theta, query groups, tying), or padding rows of another value."""
    args, _ = ARCHITECTURES[name]
    model = _model(args)
    hf_config, tensors = hf_convert.to_hf(model.state_dict(), args, vocab_size=300, eod=299)
    hf_config = json.loads(json.dumps(hf_config))  # what config.json holds
    back_args, state = hf_convert.from_hf(hf_config, tensors)
    assert hf_convert.gpt_config(back_args) == hf_convert.gpt_config(args)
    original = model.state_dict()
    assert set(state) == set(original)
    for key, value in original.items():
        if key in ("word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(state[key][:300], value[:300]) and not state[key][300:].any(), key
        else:
            assert torch.equal(state[key], value), key


def test_bf16_weights_export_as_bf16(tmp_path):
    """A --bf16 run's model weights are written in bfloat16 (config.json's dtype says so), transformers loads
    them as such, and the import gives their values back exactly (as fp32). Would catch a bf16 model doubled
    to fp32 on export or its values rounded on the way back."""
    args, _ = ARCHITECTURES["llama-gqa-untied"]
    model = _model(args).to(torch.bfloat16)
    config = _export(model, args, tmp_path)
    assert config["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    from safetensors.torch import load_file

    _, state = hf_convert.from_hf(json.loads(json.dumps(config)), load_file(str(tmp_path / "model.safetensors")))
    assert torch.equal(state["layers.1.self_attention.linear_qkv.weight"],
                       model.layers[1].self_attention.linear_qkv.weight.float())


# ------------------------------------------------------------------------------------------ end to end
LLAMA_RUN = tiny_pretrain_flags(hidden_size="64", num_attention_heads="4", micro_batch_size="2",
                                global_batch_size="8", train_iters="4", log_interval="1", lr="3e-3")
LLAMA_ARCH = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--normalization", "RMSNorm", "--swiglu",
              "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
              "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6",
              "--rotary-base", "50000"]


def _convert(*argv):
    out = subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _newest(root):
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        return checkpoint_convert.read(os.path.join(root, f"iter_{int(f.read()):07d}"))


def test_trained_llama_exports_imports_and_finetunes_on_two_ranks(tmp_path):
    """A Llama-style run (GQA, rope theta 50000, RMSNorm eps 1e-6, SwiGLU, untied, no biases; NullTokenizer's
    128 ids: no padding rows) trained on 2 gloo ranks and saved (torch_dist) -> --to hf -> transformers' logits
    equal megatron-lite's -> --from hf (torch_dist) -> the imported weights equal the trained ones bitwise ->
    --finetune --load from the import logs iterations 1..4 with the losses, bit for bit, of --finetune from the
    original checkpoint, and saves iteration 4 with 4 optimizer steps. A plain --load of the import is refused
    by name on every rank. Would catch a mapping that only works on untrained weights, flags the import records
    that a finetune run does not give (--norm-epsilon, --rotary-base), a weights-only checkpoint resumed as if
    it held an optimizer, or the iteration / optimizer not reset by --finetune."""
    run = LLAMA_RUN + LLAMA_ARCH
    original, exported, imported = (str(tmp_path / n) for n in ("run", "hf", "imported"))
    run_distributed(pretrain_losses, 2, run + ["--save", original])
    _convert("--input", original, "--output", exported, "--to", "hf")
    trained = _newest(original)["model"]
    model = GPTModel(hf_convert.gpt_config(_newest(original)["args"])).eval()
    model.load_state_dict(trained)
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    tokens = _tokens(128, shape=(2, 32))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5
    printed = _convert("--from", "hf", "--input", exported, "--output", imported, "--to", "torch_dist")
    assert "--norm-epsilon 1e-06" in printed and "--rotary-base 50000.0" in printed
    weights = _newest(imported)["model"]
    assert set(weights) == set(trained) and all(torch.equal(weights[k], trained[k]) for k in trained)

    finetune = run + ["--finetune", "--ckpt-format", "torch"]
    from_original = run_distributed(pretrain_losses, 2, finetune + ["--load", original, "--save",
                                                                    str(tmp_path / "ft_original")])[0]
    from_import = run_distributed(pretrain_losses, 2, finetune + ["--load", imported, "--save",
                                                                  str(tmp_path / "ft_import")])[0]
    assert sorted(from_import) == [1, 2, 3, 4] and from_import == from_original
    saved = _newest(tmp_path / "ft_import")
    assert saved["iteration"] == 4 and saved["opt_param_scheduler"]["num_steps"] == 4
    assert {entry["step"] for entry in saved["optimizer"]["state"].values()} == {4}
    with pytest.raises(AssertionError) as failure:
        run_distributed(pretrain_losses, 2, run + ["--load", imported])
    assert len(re.findall(r"ValueError: checkpoint \S+ holds model weights only .*start from it with --finetune",
                          str(failure.value))) == 2  # every rank


# ------------------------------------------------------------------------------------------ tokenizers
def test_byte_level_tokenizer_is_exported_with_its_ids(tmp_path):
    """A ByteLevelTokenizer run exports a tokenizer.json that transformers' AutoTokenizer loads and that
    encodes text to the UTF-8 bytes (the ids the run trained on) with eod 256 as bos/eos, and decodes back.
    Would catch GPT-2's byte-to-character table applied in another order (ids permuted), or a merge."""
    _export(_model(SMALL), SMALL, tmp_path, vocab_size=None, tokenizer="ByteLevelTokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = build_tokenizer("ByteLevelTokenizer")
    text = "Grüße, 世界!\n\tdone 🙂 ~\x7f"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == ours.tokenize(text) and tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == ours.eod == 256 and len(tokenizer) == 257


def test_hugging_face_tokenizer_without_eod_gets_the_reserved_id(tmp_path):
    """HuggingFaceTokenizer reserves the next id as eod when tokenizer.json has none; the export adds
    '<|endoftext|>' at exactly that id, so transformers' eos is the run's eod, and ids agree on text.
    Would catch an eos token at another id than the one the model learned document ends with, or the tool's
    tokenizer flags ignored in favour of the recorded tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "megatron", "lite"])}
    source = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    source.pre_tokenizer = pre_tokenizers.Whitespace()
    source.save(str(tmp_path / "source.json"))
    args = dict(SMALL, padded_vocab_size=128, tokenizer_model=str(tmp_path / "source.json"))
    payload = {"model": _model(args).state_dict(), "iteration": 0,
               "args": dict(args, tokenizer_type="HuggingFaceTokenizer")}
    config = checkpoint_convert.export_hf(payload, str(tmp_path / "out"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    ours = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "source.json"))
    assert ours.eod == 5 == tokenizer.eos_token_id == config["eos_token_id"] and config["vocab_size"] == 6
    assert tokenizer("hello megatron lite", add_special_tokens=False)["input_ids"] == [1, 3, 4]
    # A run on ids only (NullTokenizer, as for data Megatron-LM preprocessed) exported with the tokenizer the
    # ids came from: the tool's --tokenizer-type / --tokenizer-model win over the recorded ones.
    payload["args"].update(tokenizer_type="NullTokenizer", tokenizer_model=None, vocab_size=6)
    again = checkpoint_convert.export_hf(payload, str(tmp_path / "again"), "HuggingFaceTokenizer",
                                         str(tmp_path / "source.json"))
    assert again == config and os.path.isfile(tmp_path / "again" / "tokenizer.json")


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("change, named", [
    (dict(position_embedding_type="rope"), "--position-embedding-type rope"),
    (dict(normalization="RMSNorm"), "--normalization RMSNorm"),
    (dict(swiglu=True, ffn_hidden_size=64), "--swiglu"),
    (dict(group_query_attention=True, num_query_groups=2), "--group-query-attention"),
    (dict(disable_bias_linear=True), "--disable-bias-linear"),
])
def test_export_refuses_what_transformers_cannot_express(change, named):
    """A mix of GPT-2's and Llama's options (rope with LayerNorm, RMSNorm with learned positions, ...) has no
    transformers class: ValueError naming the option. Would catch an export that writes a GPT2 config whose
    model silently computes something else."""
    with pytest.raises(ValueError, match="cannot be exported") as error:
        hf_convert.to_hf(_model(dict(SMALL, **change)).state_dict(), dict(SMALL, **change), 300, 299)
    assert named in str(error.value)


def _gpt2_dict(**change):
    return json.loads(json.dumps({**hf_convert.to_hf(_model(SMALL).state_dict(), SMALL, 300, 299)[0], **change}))


def _llama_dict(**change):
    return json.loads(json.dumps({**hf_convert.to_hf(_model(LLAMA).state_dict(), LLAMA, 300, 299)[0], **change}))


@pytest.mark.parametrize("config, named", [
    (lambda: _gpt2_dict(activation_function="quick_gelu"), "activation_function='quick_gelu'"),
    (lambda: _gpt2_dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (lambda: _llama_dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), "rope_type='llama3'"),
    (lambda: _llama_dict(mlp_bias=True), "mlp_bias=True"),
    (lambda: _llama_dict(head_dim=8), "head_dim=8"),
    (lambda: _llama_dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda: {"model_type": "mistral"}, "model_type 'mistral'"),
])
def test_import_refuses_what_gpt_model_cannot_express(config, named):
    """A transformers config GPTModel cannot compute exactly (a sigmoid GELU, scaled rope, biases in only part
    of the linears, another head dim, another model type): ValueError naming the field and its value. Would
    catch an import that trains a model other than the one the config describes."""
    with pytest.raises(ValueError, match="cannot be imported") as error:
        hf_convert.from_hf(config(), {})
    assert named in str(error.value)


def test_import_refuses_weights_that_do_not_match_the_config():
    """Would catch a missing or left-over tensor going unnoticed (a config from another model)."""
    hf_config, tensors = hf_convert.to_hf(_model(LLAMA).state_dict(), LLAMA, 300, 299)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        hf_convert.from_hf(hf_config, tensors)
    hf_config, tensors = hf_convert.to_hf(_model(LLAMA).state_dict(), LLAMA, 300, 299)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight has shape"):
        hf_convert.from_hf({**hf_config, "num_key_value_heads": 1}, tensors)


def test_tool_errors(tmp_path):
    """The tool's messages for: a --from hf directory without config.json or without safetensors, an export
    into a non-empty directory, a checkpoint that does not record its tokenizer, a --tokenizer-model the
    checkpoint's tokenizer would ignore. Would catch a traceback, a half-written directory or an ignored flag
    instead of a message naming what to do."""
    def fails(*argv):
        out = subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 2, out.stdout + out.stderr
        return out.stderr

    (tmp_path / "empty").mkdir()
    assert "has no config.json" in fails("--from", "hf", "--input", str(tmp_path / "empty"), "--output",
                                         str(tmp_path / "o1"))
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert "has no *.safetensors" in fails("--from", "hf", "--input", str(tmp_path / "empty"), "--output",
                                           str(tmp_path / "o2"))
    assert "--from hf takes" in fails("--from", "hf", "--input", str(tmp_path / "empty"), "--to", "hf",
                                      "--output", str(tmp_path / "o3"))
    payload = {"model": _model(SMALL).state_dict(), "iteration": 0, "args": dict(SMALL)}
    with pytest.raises(ValueError, match="does not record its tokenizer"):
        checkpoint_convert.export_hf(payload, str(tmp_path / "o4"))
    with pytest.raises(ValueError, match="is not empty"):
        checkpoint_convert.export_hf(payload, str(tmp_path / "empty"), tokenizer_type="ByteLevelTokenizer")
    ignored = "--tokenizer-model is read by --tokenizer-type .* HuggingFaceTokenizer only, not by ByteLevelTokenizer"
    with pytest.raises(ValueError, match=ignored):
        checkpoint_convert.export_hf({**payload, "args": {**SMALL, "tokenizer_type": "ByteLevelTokenizer"}},
                                     str(tmp_path / "o6"), tokenizer_model=str(tmp_path / "tokenizer.json"))
    assert not (tmp_path / "o6").exists()
    with pytest.raises(ValueError, match="does not fit the checkpoint's padded vocabulary"):
        checkpoint_convert.export_hf(payload, str(tmp_path / "o5"), tokenizer_type="NullTokenizer", vocab_size=500)


# ------------------------------------------------------------------------------------------ import: hostile files
def _hf_dir(path, tokenizer="NullTokenizer"):
    """SMALL's model exported to `path` as a transformers directory: (its path, config.json, its tensors)."""
    from safetensors.torch import load_file

    _export(_model(SMALL), SMALL, path, vocab_size=None if tokenizer != "NullTokenizer" else 300, tokenizer=tokenizer)
    return str(path), json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def _import(directory, output):
    """checkpoint_convert.py --from hf in this process (a raw exception propagates): its exit code."""
    try:
        checkpoint_convert.main(["--from", "hf", "--input", str(directory), "--output", str(output)])
    except SystemExit as e:
        return e.code
    return 0


def test_import_reads_the_shards_the_index_names_and_refuses_a_tensor_in_two_files(tmp_path, capsys):
    """A sharded directory (model.safetensors.index.json and two shards) plus a stale third shard that sorts after
    them and holds zeros for the embedding: the import takes each tensor from the shard the index names, as
    transformers does, and says which file it left unread. Without an index, a stray file holding a tensor of
    model.safetensors is refused, naming both files; an index naming a missing shard, or a tensor its shard lacks,
    is refused naming the index. Would catch every *.safetensors read in sorted order with a later file silently
    replacing real tensors."""
    from safetensors.torch import save_file

    directory, config, tensors = _hf_dir(tmp_path / "sharded")
    _, expected = hf_convert.from_hf(config, tensors)
    os.remove(os.path.join(directory, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, os.path.join(directory, file))
    index = {"metadata": {}, "weight_map": {n: file for file, part in shards.items() for n in part}}
    (tmp_path / "sharded" / hf_files.INDEX).write_text(json.dumps(index))
    stale = {"transformer.wte.weight": torch.zeros_like(tensors["transformer.wte.weight"])}
    save_file(stale, os.path.join(directory, "model-00003-of-00003.safetensors"))
    payload = checkpoint_convert.import_hf(directory)
    assert set(payload["model"]) == set(expected)
    assert all(torch.equal(payload["model"][k], v) for k, v in expected.items())
    assert "model-00003-of-00003.safetensors left unread" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert torch.equal(hf.transformer.wte.weight, tensors["transformer.wte.weight"])  # transformers: the same

    index["weight_map"]["transformer.ln_f.bias"] = "model-00009-of-00009.safetensors"
    (tmp_path / "sharded" / hf_files.INDEX).write_text(json.dumps(index))
    assert _import(directory, tmp_path / "o1") == 2
    assert re.search(r"index.json names the shard model-00009-of-00009.safetensors, which \S+ does not hold",
                     capsys.readouterr().err)
    other = next(file for file, part in shards.items() if "transformer.ln_f.bias" not in part)
    index["weight_map"]["transformer.ln_f.bias"] = other
    (tmp_path / "sharded" / hf_files.INDEX).write_text(json.dumps(index))
    assert _import(directory, tmp_path / "o2") == 2
    assert f"puts ['transformer.ln_f.bias'] in {other}, which does not hold it" in capsys.readouterr().err

    directory, _, _ = _hf_dir(tmp_path / "stray")
    save_file(stale, os.path.join(directory, "model_copy.safetensors"))
    assert _import(directory, tmp_path / "o3") == 2
    assert re.search(r"stray/model.safetensors and \S+stray/model_copy.safetensors both hold the tensor "
                     r"transformer.wte.weight", capsys.readouterr().err)
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


def test_import_refuses_model_safetensors_next_to_an_index_that_does_not_name_it(tmp_path, capsys):
    """A directory with model.safetensors and a model.safetensors.index.json whose shards hold other weights
    (here a zeroed embedding): transformers loads model.safetensors and ignores the index, so the import must not
    quietly take the shards' weights; it is refused, naming both files. An index that names model.safetensors
    itself (one shard) is read as before. Would catch the index followed with model.safetensors only listed as
    unread: rc 0 and weights other than those from_pretrained gives for the same directory."""
    from safetensors.torch import save_file

    directory, config, tensors = _hf_dir(tmp_path / "both")
    names = sorted(tensors)
    stale = {**tensors, "transformer.wte.weight": torch.zeros_like(tensors["transformer.wte.weight"])}
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: stale[n] for n in part}, os.path.join(directory, file))
    index = {"metadata": {}, "weight_map": {n: file for file, part in shards.items() for n in part}}
    (tmp_path / "both" / hf_files.INDEX).write_text(json.dumps(index))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert torch.equal(hf.transformer.wte.weight, tensors["transformer.wte.weight"])  # model.safetensors, not the index
    assert _import(directory, tmp_path / "o1") == 2
    assert f"holds both model.safetensors and {hf_files.INDEX}" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists()

    for file in shards:
        os.remove(os.path.join(directory, file))
    index["weight_map"] = {n: "model.safetensors" for n in names}
    (tmp_path / "both" / hf_files.INDEX).write_text(json.dumps(index))
    payload = checkpoint_convert.import_hf(directory)
    _, expected = hf_convert.from_hf(config, tensors)
    assert all(torch.equal(payload["model"][k], v) for k, v in expected.items())


@pytest.mark.parametrize("dtype, stored", [(torch.int64, "I64"), (torch.int32, "I32"), (torch.bool, "BOOL"),
                                           (torch.uint8, "U8")])
def test_import_refuses_integer_and_bool_weights(tmp_path, capsys, dtype, stored):
    """An integer or bool tensor where a weight belongs is refused naming the tensor and the file (and by from_hf,
    naming the tensor). Would catch it cast to float32 without a word (a quantized or mislabelled checkpoint
    imported as nonsense weights)."""
    from safetensors.torch import save_file

    directory, config, tensors = _hf_dir(tmp_path / "hf")
    tensors["transformer.h.0.ln_1.weight"] = tensors["transformer.h.0.ln_1.weight"].to(dtype)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    assert _import(directory, tmp_path / "out") == 2
    assert f"model.safetensors: the tensor transformer.h.0.ln_1.weight is {stored}, not floating point" in (
        capsys.readouterr().err)
    with pytest.raises(ValueError, match=f"transformer.h.0.ln_1.weight is {dtype}, not floating point"):
        hf_convert.from_hf(config, tensors)
    assert not (tmp_path / "out").exists()


def test_import_compares_the_layer_count_before_building_the_model(tmp_path, capsys, monkeypatch):
    """config.json with n_layer 10**7 over the tensors of 2 layers is refused by name before a model is built
    (a GPTModel of more layers than the tensors hold fails this test rather than running for hours). Would catch
    the config's model built layer by layer before its tensors were compared."""
    directory, config, tensors = _hf_dir(tmp_path / "hf")
    built = hf_convert.GPTModel

    def guarded(config):
        assert config.num_layers <= 2, f"a GPTModel of {config.num_layers} layers built before the tensors' check"
        return built(config)

    monkeypatch.setattr(hf_convert, "GPTModel", guarded)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "n_layer": 10**7}))
    assert _import(directory, tmp_path / "out") == 2
    assert "n_layer=10000000, the tensors hold 2 layers (transformer.h.{0, 1})" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"n_layer=3, the tensors hold 2 layers"):
        hf_convert.from_hf({**config, "n_layer": 3}, tensors)


def _hand_written_safetensors(header: dict, data: bytes = b"") -> bytes:
    """A safetensors file written byte by byte: 8-byte little-endian header length, the JSON header, the data."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def _corrupt(name):
    """Functions spoiling one file of a directory _hf_dir wrote: (the file's name, what to do to the directory)."""
    weights = "model.safetensors"

    def rewrite(file, content):
        def spoil(path):
            (path / file).write_bytes(content(path / file) if callable(content) else content)
        return spoil

    def tensor_value(value):
        def spoil(path):
            from safetensors.torch import load_file, save_file

            tensors = load_file(str(path / weights))
            tensors["transformer.h.1.attn.c_proj.weight"][3, 5] = value
            save_file(tensors, str(path / weights))
        return spoil

    return {
        "not safetensors": (weights, rewrite(weights, b"this is not a safetensors file\n" * 20)),
        "truncated": (weights, rewrite(weights, lambda f: f.read_bytes()[:f.stat().st_size // 2])),
        "huge header": (weights, rewrite(weights, lambda f: (1 << 40).to_bytes(8, "little") + f.read_bytes()[8:])),
        "offsets past the end": (weights, rewrite(weights, _hand_written_safetensors(
            {"transformer.wte.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 1 << 62]}}, bytes(8)))),
        "shape overflowing": (weights, rewrite(weights, _hand_written_safetensors(
            {"transformer.wte.weight": {"dtype": "F32", "shape": [1 << 40] * 3, "data_offsets": [0, 0]}}))),
        "config a list": ("config.json", rewrite("config.json", b"[1, 2, 3]")),
        "config not JSON": ("config.json", rewrite("config.json", b'{"model_type": "gpt2", ')),
        "config field a string": ("n_embd='32' must be a positive integer", rewrite("config.json", lambda f: json.dumps(
            {**json.loads(f.read_text()), "n_embd": "32"}).encode())),
        "tokenizer garbage": ("tokenizer.json", rewrite("tokenizer.json", b'{"version": "1.0", "model": 7}')),
        "NaN weight": ("model.safetensors: the tensor transformer.h.1.attn.c_proj.weight holds NaN",
                       tensor_value(float("nan"))),
        "Inf weight": ("model.safetensors: the tensor transformer.h.1.attn.c_proj.weight holds NaN or Inf",
                       tensor_value(float("-inf"))),
    }[name]


@pytest.mark.parametrize("case", ["not safetensors", "truncated", "huge header", "offsets past the end",
                                  "shape overflowing", "config a list", "config not JSON", "config field a string",
                                  "tokenizer garbage", "NaN weight", "Inf weight"])
def test_import_names_the_file_of_every_input_problem(tmp_path, capsys, case):
    """Each spoiled input is the tool's `error:` line (exit 2) naming the file (or the tensor, for NaN / Inf
    weights, which would otherwise fail only at the first gradient, naming buckets), and --output is left as it
    was (no tokenizer.json copied, no directory). Would catch a raw SafetensorError / JSONDecodeError /
    AttributeError / TypeError traceback, a garbage tokenizer.json copied before it was checked, or NaN weights
    imported."""
    directory, _, _ = _hf_dir(tmp_path / "hf", tokenizer="ByteLevelTokenizer")
    named, spoil = _corrupt(case)
    spoil(tmp_path / "hf")
    assert _import(directory, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "error: " in err and named in err, err
    assert not (tmp_path / "out").exists()


def test_import_prints_the_paths_as_given(tmp_path, capsys, monkeypatch):
    """The command the import prints names --load and --tokenizer-model as the user spelled --output (relative
    here), while the checkpoint records the tokenizer's absolute path (found from any working directory). Would
    catch an absolute path printed where the user gave a relative one."""
    _hf_dir(tmp_path / "hf", tokenizer="ByteLevelTokenizer")
    monkeypatch.chdir(tmp_path)
    assert _import("hf", "out") == 0
    printed = capsys.readouterr().out
    assert "--load out " in printed and f"--tokenizer-model {os.path.join('out', 'tokenizer.json')}" in printed
    assert str(tmp_path) not in printed, printed
    args = _newest(tmp_path / "out")["args"]
    assert args["tokenizer_model"] == str(tmp_path / "out" / "tokenizer.json")


def test_a_failed_write_leaves_the_output_as_it_was(tmp_path, monkeypatch):
    """The checkpoint's write fails (a full disk, here an OSError planted in write()): a new --output is not left
    behind, and one that already held a tokenizer.json still holds that file unchanged. Would catch the
    directory's tokenizer copied over before the write and left replaced (or a copied one left) after it failed."""
    directory, _, _ = _hf_dir(tmp_path / "hf", tokenizer="ByteLevelTokenizer")

    def full_disk(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint_convert, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _import(directory, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "tokenizer.json").write_text("the user's own file")
    with pytest.raises(OSError, match="No space left"):
        _import(directory, tmp_path / "kept")
    assert os.listdir(tmp_path / "kept") == ["tokenizer.json"]
    assert (tmp_path / "kept" / "tokenizer.json").read_text() == "the user's own file"
