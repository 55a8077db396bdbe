"""Megatron's tokenizer types (`megatron_lite/data/tokenizer.py`, `gpt2_bpe.py`) with Megatron's flags, in
tools/preprocess_data.py, pretrain_gpt.py and tools/checkpoint_convert.py --to hf.

The spine: one corpus through megatron-lite's preprocessing and megatron-core 0.16.1's (its tokenizer for the
type + IndexedDatasetBuilder, tests/support/mcore_tokenize.py, in one subprocess) gives byte-identical .bin/.idx
for GPT2BPETokenizer, the three SentencePiece types and HuggingFaceTokenizer. The fixtures are trained here (a
byte-level BPE with `tokenizers`' BpeTrainer written as GPT-2's vocab.json/merges.txt, a SentencePiece model with
SentencePieceTrainer): nothing is downloaded. Each test skips where its package is missing.
"""

import importlib.util
import io
import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from mcore_reference import requires_mcore
from pretrain_testing import REPO, flag_error

from megatron_lite.data import IndexedDataset
from megatron_lite.data.gpt2_bpe import gpt2_pattern
from megatron_lite.data.tokenizer import build_tokenizer

HAVE = {name: importlib.util.find_spec(name) is not None
        for name in ("tokenizers", "sentencepiece", "transformers", "safetensors", "regex")}


def _needs(*names):
    missing = [name for name in names if not HAVE[name]]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


DOCUMENTS = [
    "Hello world, it's 2024! Numbers 12345 and ²³ ½ Ⅻ.",
    "Ünïcödé — naïve café; 東京タワー 한국어 Ελληνικά",
    "tabs\tand  double  spaces\n\nnew lines   \x1c\x1f end",
    "don't won't I'll we've they're I'm he'd",
    "emoji 😀🎉, combining e\u0301, zero\u200bwidth and a NEL\x85here",
    "two documents in one <|endoftext|> as GPT-2 data often has",
    " leading space", "trailing  ", "</s> and <s> as plain text",
]
CORPUS = DOCUMENTS * 3


def _load_preprocess():
    spec = importlib.util.spec_from_file_location("preprocess_data_tok", os.path.join(REPO, "tools",
                                                                                      "preprocess_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preprocess = _load_preprocess()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """corpus.jsonl and a tokenizer of each kind: gpt2/ (vocab.json, merges.txt, and the tokenizer_config.json
    naming transformers' GPT-2 class for megatron-core), spm/tokenizer.model, llama3/ (a tokenizer.json whose
    post-processor adds BOS, eos_token '<|end_of_text|>' in tokenizer_config.json: the issue's Llama-3 case)."""
    root = tmp_path_factory.mktemp("tokenizers")
    paths = {"root": root, "corpus": root / "corpus.jsonl"}
    paths["corpus"].write_text("".join(json.dumps({"text": text}) + "\n" for text in CORPUS), encoding="utf-8")
    if HAVE["tokenizers"]:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        gpt2 = Tokenizer(models.BPE())
        gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        gpt2.train_from_iterator(DOCUMENTS * 20, trainers.BpeTrainer(
            vocab_size=420, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
        (root / "gpt2").mkdir()
        gpt2.model.save(str(root / "gpt2"))  # vocab.json, merges.txt ('#version: 0.2' first), GPT-2's formats
        (root / "gpt2" / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "GPT2Tokenizer", **dict.fromkeys(("bos_token", "eos_token", "unk_token"),
                                                                  "<|endoftext|>")}))
        llama3 = Tokenizer(models.BPE())
        llama3.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        llama3.decoder = decoders.ByteLevel()
        llama3.train_from_iterator(DOCUMENTS * 20, trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        llama3.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
        (root / "llama3").mkdir()
        llama3.save(str(root / "llama3" / "tokenizer.json"))
        (root / "llama3" / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
             "eos_token": "<|end_of_text|>"}))
    if HAVE["sentencepiece"]:
        import sentencepiece

        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(DOCUMENTS * 20), model_writer=model, vocab_size=400, model_type="bpe",
            character_coverage=1.0, byte_fallback=True, minloglevel=2)
        (root / "spm").mkdir()
        (root / "spm" / "tokenizer.model").write_bytes(model.getvalue())
    return paths


def _flags(files, tokenizer_type):
    if tokenizer_type == "GPT2BPETokenizer":
        return {"vocab_file": str(files["root"] / "gpt2" / "vocab.json"),
                "merge_file": str(files["root"] / "gpt2" / "merges.txt")}
    if tokenizer_type == "HuggingFaceTokenizer":
        return {"tokenizer_model": str(files["root"] / "llama3")}
    return {"tokenizer_model": str(files["root"] / "spm" / "tokenizer.model")}


def _argv(flags):
    return [item for dest, value in flags.items() for item in ("--" + dest.replace("_", "-"), value)]


TYPES = ["GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
         "HuggingFaceTokenizer"]


# ------------------------------------------------------------------------------ the same files as megatron-core
@requires_mcore
@_needs("tokenizers", "sentencepiece", "transformers")
def test_preprocessing_matches_megatron_core_byte_for_byte(files, tmp_path, capsys):
    """Each tokenizer type: tools/preprocess_data.py and megatron-core's tokenizer + IndexedDatasetBuilder write
    the same .bin and .idx, with the same vocab_size and eod. Would catch an id of the BPE or the SentencePiece
    model differing, a BOS added (Llama2Tokenizer, the Llama-3 tokenizer's post-processor), the '<|endoftext|>'
    inside a document read as text, an eod chosen by name instead of the eos_token (the issue's new id 400 where
    megatron-core has 1), or another dtype."""
    cases = []
    for tokenizer_type in TYPES:
        flags = _flags(files, tokenizer_type)
        prefix = str(tmp_path / f"lite_{tokenizer_type}")
        preprocess.main(["--input", str(files["corpus"]), "--output-prefix", prefix, "--tokenizer-type",
                         tokenizer_type] + _argv(flags))
        cases.append({"tokenizer_type": tokenizer_type, **flags, "tokenizer_dir": str(files["root"] / "gpt2"),
                      "input": str(files["corpus"]), "output_prefix": str(tmp_path / f"mcore_{tokenizer_type}")})
    capsys.readouterr()
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = subprocess.run([sys.executable, os.path.join(REPO, "tests", "support", "mcore_tokenize.py"),
                             str(tmp_path / "cases.json")], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    for case, reference in zip(cases, theirs):
        tokenizer_type = case["tokenizer_type"]
        ours = build_tokenizer(tokenizer_type, **_flags(files, tokenizer_type))
        assert (ours.vocab_size, ours.eod) == (reference["vocab_size"], reference["eod"]), tokenizer_type
        for ext in (".bin", ".idx"):
            lite = (tmp_path / f"lite_{tokenizer_type}{ext}").read_bytes()
            assert lite == (tmp_path / f"mcore_{tokenizer_type}{ext}").read_bytes(), (tokenizer_type, ext)
    assert build_tokenizer("HuggingFaceTokenizer", **_flags(files, "HuggingFaceTokenizer")).eod == 1
    dataset = IndexedDataset(str(tmp_path / "lite_GPT2BPETokenizer"))
    assert len(dataset) == len(CORPUS) and list(dataset[5]).count(0) == 2  # '<|endoftext|>' (id 0) in the text


# ------------------------------------------------------------------------------ GPT-2's BPE in plain Python
@_needs("regex")
def test_gpt2_pattern_splits_every_character_as_megatron_lms_regex():
    """The `re` spelling of GPT-2's pre-tokenization regex splits text of every character Python's Unicode
    database assigns exactly as Megatron-LM's `regex` pattern does. Would catch \\p{L} / \\p{N} approximated by
    \\w or str.isalpha(), or \\s taken from `re` (which counts U+001C..U+001F as space)."""
    import regex

    theirs = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    chars = [chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    glue = [" ", "a", "1", "  ", "'s", "\n", ".", "\x1c"]
    text = "".join(ch + glue[i % len(glue)] for i, ch in enumerate(chars))
    assert gpt2_pattern().findall(text) == theirs.findall(text)


def test_gpt2_bpe_reads_megatron_lms_files(tmp_path):
    """A hand-made vocab.json / merges.txt: merges apply lowest rank first, merges.txt's first line (the header)
    and last line are skipped as Megatron-LM skips them, a token missing from vocab.json is id 0, and the text
    '<|endoftext|>' is the eod id. Needs no package."""
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3, "Ġ": 4, "Ġab": 5, "c": 6, "bc": 7}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nb c\na b\nĠ ab\nc c", encoding="utf-8")  # 'c c' dropped
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                                merge_file=str(tmp_path / "merges.txt"))
    assert (tokenizer.vocab_size, tokenizer.eod) == (8, 0)
    # 'abc': (b, c) ranks before (a, b) -> a bc; ' ab' -> Ġab; ' cc' -> Ġ c c ('c c' was the dropped last
    # line); '<|endoftext|>' -> eod; 'd' is not in vocab.json -> 0.
    assert tokenizer.tokenize("abc ab cc<|endoftext|>d") == [1, 7, 5, 4, 6, 6, 0, 0]
    assert tokenizer.detokenize([1, 7, 5, 0]) == "abc ab"


# ------------------------------------------------------------------------------ HuggingFaceTokenizer's eod
@_needs("tokenizers", "transformers")
@pytest.mark.parametrize("layout", ["config", "special_tokens_map wins", "dict token", "sep only", "file form"])
def test_hugging_face_eod_is_the_eos_token_transformers_reads(files, tmp_path, layout):
    """eod = the eos_token transformers' AutoTokenizer reads (megatron-core's eod), from tokenizer_config.json
    or special_tokens_map.json (which wins), as a string or an AddedToken dict, else the sep_token; given as a
    directory or as its tokenizer.json. Would catch the eod chosen by name (<|endoftext|> is also in this vocab)."""
    import transformers

    directory = tmp_path / "tok"
    directory.mkdir()
    from tokenizers import Tokenizer

    source = Tokenizer.from_file(str(files["root"] / "llama3" / "tokenizer.json"))
    source.add_special_tokens(["<|endoftext|>", "<sep>"])
    source.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end_of_text|>"}
    special = None
    if layout == "special_tokens_map wins":
        special = {"eos_token": "<|begin_of_text|>"}
    elif layout == "dict token":
        config["eos_token"] = {"__type": "AddedToken", "content": "<|end_of_text|>", "special": True}
    elif layout == "sep only":
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "sep_token": "<sep>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if special:
        (directory / "special_tokens_map.json").write_text(json.dumps(special))
    given = str(directory / "tokenizer.json") if layout == "file form" else str(directory)
    ours = build_tokenizer("HuggingFaceTokenizer", given)
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    expected = theirs.eos_token_id if layout != "sep only" else theirs.sep_token_id
    assert ours.eod == expected != source.token_to_id("<|endoftext|>")


# ------------------------------------------------------------------------------ export: the training ids
@_needs("tokenizers", "transformers", "safetensors")
@pytest.mark.parametrize("tokenizer_type", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_exported_tokenizer_gives_the_ids_in_the_bin(files, tmp_path, capsys, tokenizer_type):
    """checkpoint_convert.py --to hf of a run with the type: transformers' AutoTokenizer on the exported directory
    gives, by default, each document's ids as the .bin holds them (without the eod preprocessing appended) and
    eod as eos_token_id. Would catch the Llama-3 tokenizer's BOS post-processor exported as it is (a BOS the data
    never had), a GPT-2 export whose BPE or '<|endoftext|>' differ, or an import (--from hf) that loses the eod."""
    import torch
    import transformers

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import checkpoint_convert
    import hf_convert

    from megatron_lite.models import GPTModel

    flags = _flags(files, tokenizer_type)
    prefix = str(tmp_path / "data")
    preprocess.main(["--input", str(files["corpus"]), "--output-prefix", prefix, "--tokenizer-type",
                     tokenizer_type] + _argv(flags))
    eod = build_tokenizer(tokenizer_type, **flags).eod
    args = dict(num_layers=1, hidden_size=16, num_attention_heads=2, padded_vocab_size=512,
                max_position_embeddings=64, tokenizer_type=tokenizer_type, eod=eod, **flags)  # as a run records
    torch.manual_seed(0)
    model = GPTModel(hf_convert.gpt_config(args))
    checkpoint_convert.export_hf({"model": model.state_dict(), "iteration": 0, "args": args}, str(tmp_path / "hf"))
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    dataset = IndexedDataset(prefix)
    assert exported.eos_token_id == eod
    for i, text in enumerate(CORPUS):
        stored = [int(t) for t in dataset[i]]
        assert stored[-1] == eod and exported(text).input_ids == stored[:-1], text
    # And back (--from hf): the imported checkpoint's tokenizer keeps the eod, its tokenizer_config.json copied
    # beside tokenizer.json (a bare tokenizer.json would give HuggingFaceTokenizer another eod).
    checkpoint_convert.main(["--from", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back")])
    capsys.readouterr()
    assert build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "back" / "tokenizer.json")).eod == eod


@_needs("sentencepiece", "transformers", "safetensors")
def test_sentencepiece_export_writes_no_tokenizer_and_says_how_to_get_the_ids(files, tmp_path, capsys):
    """A SentencePiece run's export has the model and config but no tokenizer files (transformers would need
    protobuf and add a BOS), and a note naming the model and the ids (no BOS, eod). Would catch a tokenizer
    written that gives other ids than training used."""
    import torch

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import checkpoint_convert
    import hf_convert

    from megatron_lite.models import GPTModel

    flags = _flags(files, "Llama2Tokenizer")
    args = dict(num_layers=1, hidden_size=16, num_attention_heads=2, padded_vocab_size=512,
                max_position_embeddings=64, tokenizer_type="Llama2Tokenizer", **flags)
    torch.manual_seed(0)
    model = GPTModel(hf_convert.gpt_config(args))
    checkpoint_convert.export_hf({"model": model.state_dict(), "iteration": 0, "args": args}, str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    out = capsys.readouterr().out
    assert "no tokenizer written for Llama2Tokenizer" in out and flags["tokenizer_model"] in out and "no BOS" in out


# ------------------------------------------------------------------------------ refusals
def _bad_cases(root):
    gpt2, spm, llama3 = root / "gpt2", root / "spm" / "tokenizer.model", root / "llama3"
    vocab, merges = str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt")
    return {
        "no vocab file": (["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", merges],
                          "--tokenizer-type GPT2BPETokenizer needs --vocab-file vocab.json"),
        "no merge file": (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab],
                          "--tokenizer-type GPT2BPETokenizer needs --merge-file merges.txt"),
        "no model": (["--tokenizer-type", "Llama2Tokenizer"],
                     "--tokenizer-type Llama2Tokenizer needs --tokenizer-model \\(a SentencePiece tokenizer.model\\)"),
        "no hf model": (["--tokenizer-type", "HuggingFaceTokenizer"],
                        "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
        "merges as vocab": (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", merges, "--merge-file", merges],
                            "--vocab-file .* is not a GPT-2 vocab.json"),
        "vocab as merges": (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", vocab],
                            "--merge-file .* is not a GPT-2 merges.txt: .*a vocab.json goes to --vocab-file"),
        "tokenizer.json as spm": (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                   str(llama3 / "tokenizer.json")],
                                  "is not a SentencePiece model .*goes with --tokenizer-type HuggingFaceTokenizer"),
        "spm as tokenizer.json": (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(spm)],
                                  "is not a tokenizer.json .*a SentencePiece .model goes with"),
        "gpt2 dir as hf": (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(gpt2)],
                           "no tokenizer.json in that directory .*GPT2BPETokenizer --vocab-file --merge-file"),
        "vocab file ignored": (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(spm),
                                "--vocab-file", vocab],
                               "--vocab-file is read by --tokenizer-type GPT2BPETokenizer only, not by "
                               "SentencePieceTokenizer"),
        "model ignored": (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                           "--tokenizer-model", str(spm)],
                          "--tokenizer-model is read by .* only, not by GPT2BPETokenizer"),
        "merge file ignored": (["--merge-file", merges], "--merge-file is read by --tokenizer-type GPT2BPETokenizer "
                                                         "only, not by ByteLevelTokenizer"),
        "missing file": (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(root / "nope.json"),
                          "--merge-file", merges], "--vocab-file .*nope.json': no such file"),
    }


BAD = list(_bad_cases(Path("/")))


@_needs("tokenizers", "sentencepiece")
@pytest.mark.parametrize("case", BAD)
def test_bad_tokenizer_flags_name_the_flag_and_the_remedy(files, tmp_path, capsys, case):
    """Every refusal, in tools/preprocess_data.py (a usage error before any output) and pretrain_gpt.py (a flag
    error before any process starts, for the checks that need no file read) and build_tokenizer (ValueError).
    Would catch a traceback, an AssertionError as in Megatron-LM, or a flag silently ignored (the data tokenized
    with another tokenizer than asked for)."""
    import re

    argv, message = _bad_cases(files["root"])[case]
    text = tmp_path / "text.txt"
    text.write_text("a document\n")
    with pytest.raises(SystemExit) as exc:
        preprocess.main(["--input", str(text), "--output-prefix", str(tmp_path / "out")] + argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and re.search(message, err) and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "out.bin")
    if case in ("no vocab file", "no merge file", "no model", "no hf model", "vocab file ignored", "model ignored",
                "merge file ignored", "missing file"):
        assert re.search(message, flag_error(argv + ["--mock-data"], capsys))


@_needs("sentencepiece", "tokenizers")
def test_tokenizer_files_that_cannot_give_an_eod_are_refused(files, tmp_path):
    """A SentencePiece model without an eos piece (megatron-core's eod would be -1, written as 65535), a
    vocab.json without '<|endoftext|>' (Megatron-LM: KeyError), an eos_token not in tokenizer.json's vocabulary
    (transformers would add a new id), and a missing `sentencepiece` package: each a ValueError that says what to
    do."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(DOCUMENTS * 20), model_writer=model,
                                             vocab_size=340, eos_id=-1, byte_fallback=True, minloglevel=2)
    (tmp_path / "no_eos.model").write_bytes(model.getvalue())
    with pytest.raises(ValueError, match="no end-of-sentence piece .*train it with an eos piece"):
        build_tokenizer("GPTSentencePieceTokenizer", str(tmp_path / "no_eos.model"))
    vocab = json.loads((files["root"] / "gpt2" / "vocab.json").read_text())
    del vocab["<|endoftext|>"]
    (tmp_path / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    with pytest.raises(ValueError, match="has no '<\\|endoftext\\|>' token"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                        merge_file=str(files["root"] / "gpt2" / "merges.txt"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_bytes((files["root"] / "llama3" / "tokenizer.json").read_bytes())
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    with pytest.raises(ValueError, match="the eos_token '<eos>' .* is not in tokenizer.json's vocabulary"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "hf"))
    saved = sys.modules.get("sentencepiece")
    sys.modules["sentencepiece"] = None  # import raises ImportError
    try:
        with pytest.raises(ValueError, match="needs the optional 'sentencepiece' package"):
            build_tokenizer("SentencePieceTokenizer", str(files["root"] / "spm" / "tokenizer.model"))
    finally:
        sys.modules["sentencepiece"] = saved


# ------------------------------------------------------------------------------ the eod a checkpoint trained with
_RECORDED_BEFORE_EOS_RULE = ("tokenizer_type", "tokenizer_model", "vocab_size", "init_method_std", "hidden_dropout",
                             "attention_dropout")
"""checkpointing/save.py's RECORDED_ARGS before 98f4df2 (HuggingFaceTokenizer's eod chosen by name then)."""


def _pretrain_saving_as_before_the_eos_rule(argv):
    """pretrain_outcome(argv) with checkpoints whose args are recorded as before 98f4df2 (no vocab_file,
    merge_file nor eod). A run_distributed worker: restores save.RECORDED_ARGS for the pool's next test."""
    from pretrain_testing import pretrain_outcome

    from megatron_lite.checkpointing import save

    recorded = save.RECORDED_ARGS
    save.RECORDED_ARGS = _RECORDED_BEFORE_EOS_RULE
    try:
        return pretrain_outcome(argv)
    finally:
        save.RECORDED_ARGS = recorded


@_needs("tokenizers", "transformers", "safetensors")
def test_a_run_whose_eod_would_change_is_refused_on_resume_and_export(files, tmp_path, capsys):
    """A HuggingFaceTokenizer run saved before 98f4df2 took '<|endoftext|>' / '</s>' by name as eod, else a new id
    (400 for the Llama-3 fixture, whose tokenizer_config.json names eos_token '<|end_of_text|>', id 1, the eod
    since 98f4df2; both pad to 512 rows, so the architecture check passes). Resuming it with the same
    --tokenizer-model, or exporting it (--to hf, --to megatron: megatron-core takes the eos_token), is refused,
    naming the two eods and the remedy; with the remedy (a directory holding only its tokenizer.json: the by-name
    rule) it resumes and exports with eod 400. A new
    checkpoint records its eod: resuming it after its tokenizer_config.json named another eos_token is refused.
    Would catch a resume that silently changes the eod its data and --eod-mask-loss mean (the built-in corpus
    rebuilt with another eod, preprocessed files read with the wrong one) and an export whose eos_token_id is not
    the eod training used."""
    from distributed_helper import run_distributed
    from pretrain_testing import pretrain_outcome, tiny_pretrain_flags

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import checkpoint_convert

    llama3 = files["root"] / "llama3"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((llama3 / "tokenizer.json").read_bytes())
    assert build_tokenizer("HuggingFaceTokenizer", str(bare)).eod == 400
    assert build_tokenizer("HuggingFaceTokenizer", str(llama3)).eod == 1
    old, new = str(tmp_path / "old"), str(tmp_path / "new")

    def flags(model, save, iters):
        return tiny_pretrain_flags(num_layers="1", train_iters=str(iters), log_interval="1",
                                   lr_decay_iters="4") + [
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(model), "--save", save]

    # The old run (its eod was 400: today's rule on its bare tokenizer.json gives the same).
    [(status, _)] = run_distributed(_pretrain_saving_as_before_the_eos_rule, 1, flags(bare, old, 2))
    assert status == "ok"
    [(status, message)] = run_distributed(pretrain_outcome, 1, flags(llama3, old, 4) + ["--load", old])
    assert status == "error" and "eod" in message and "400" in message and "1" in message, message
    assert "tokenizer.json" in message and "--finetune" in message, message
    with pytest.raises(SystemExit):
        checkpoint_convert.main(["--input", old, "--output", str(tmp_path / "hf_refused"), "--to", "hf",
                                 "--tokenizer-model", str(llama3)])
    assert "400" in capsys.readouterr().err and not os.path.exists(tmp_path / "hf_refused" / "config.json")
    [(status, _)] = run_distributed(pretrain_outcome, 1, flags(bare, old, 4) + ["--load", old])
    assert status == "ok"
    checkpoint_convert.main(["--input", old, "--output", str(tmp_path / "hf"), "--to", "hf"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 400
    # An old run that recorded the Llama-3 directory (eod 400 by name then): Megatron-LM would take its eos_token.
    old_llama3 = str(tmp_path / "old_llama3")
    [(status, _)] = run_distributed(_pretrain_saving_as_before_the_eos_rule, 1, flags(llama3, old_llama3, 2))
    assert status == "ok"
    with pytest.raises(SystemExit):
        checkpoint_convert.main(["--input", old_llama3, "--output", str(tmp_path / "mlm"), "--to", "megatron"])
    err = capsys.readouterr().err
    assert "eod 400" in err and "'<|end_of_text|>'" in err and "Megatron-LM" in err, err
    assert not os.path.exists(tmp_path / "mlm")
    # A new run records its eod (1); its tokenizer_config.json then names another eos_token.
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "tokenizer.json").write_bytes((llama3 / "tokenizer.json").read_bytes())
    (moved / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    [(status, _)] = run_distributed(pretrain_outcome, 1, flags(moved, new, 2))
    assert status == "ok"
    (moved / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|begin_of_text|>"}))
    [(status, message)] = run_distributed(pretrain_outcome, 1, flags(moved, new, 4) + ["--load", new])
    assert status == "error" and "eod" in message and "'<|begin_of_text|>'" in message, message
    capsys.readouterr()


@_needs("tokenizers", "safetensors")
def test_checkpoint_convert_refuses_tokenizer_flags_it_would_ignore(files, tmp_path, capsys):
    """tools/checkpoint_convert.py reads its tokenizer flags for --to hf only, and --vocab-size for NullTokenizer
    only: --vocab-file / --merge-file / --tokenizer-model / --tokenizer-type / --vocab-size with --to torch,
    --from hf or --export-weights, and --vocab-size with another --tokenizer-type, are usage errors naming the
    flag, before anything is written. Would catch a flag accepted and silently ignored (a user who believes the
    conversion used the tokenizer given)."""
    import torch

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import checkpoint_convert
    import hf_convert

    from megatron_lite.models import GPTModel

    vocab = str(files["root"] / "gpt2" / "vocab.json")
    for extra, flag in ((["--to", "torch", "--output", str(tmp_path / "t")], "--vocab-file"),
                        (["--export-weights", str(tmp_path / "w.pt")], "--vocab-file"),
                        (["--from", "hf", "--output", str(tmp_path / "f")], "--vocab-file")):
        with pytest.raises(SystemExit) as exc:
            checkpoint_convert.main(["--input", str(tmp_path / "run")] + extra + ["--vocab-file", vocab])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"{flag} is read by --to hf only" in err, err
    with pytest.raises(SystemExit):
        checkpoint_convert.main(["--input", str(tmp_path / "run"), "--to", "torch", "--output", str(tmp_path / "t"),
                                 "--vocab-size", "1000"])
    assert "--vocab-size is read by --to hf only" in capsys.readouterr().err
    args = dict(num_layers=1, hidden_size=16, num_attention_heads=2, padded_vocab_size=384,
                max_position_embeddings=64, tokenizer_type="ByteLevelTokenizer", eod=256)
    torch.manual_seed(0)
    payload = {"model": GPTModel(hf_convert.gpt_config(args)).state_dict(), "iteration": 0, "args": args}
    with pytest.raises(ValueError, match="--vocab-size sets the vocabulary of --tokenizer-type NullTokenizer only"):
        checkpoint_convert.export_hf(payload, str(tmp_path / "hf"), vocab_size=1000)
    assert not (tmp_path / "hf").exists()


@_needs("tokenizers")
def test_a_megatron_lm_import_resumes_with_megatron_cores_eod(files):
    """A Megatron-LM checkpoint imported by checkpoint_convert.py --from megatron (megatron_read's args) records
    the run's --vocab-file / --merge-file, like a megatron-lite run since 98f4df2, so --load does not take it for a
    megatron-lite HuggingFaceTokenizer run saved before 98f4df2 (eod by name): with the Llama-3 fixture (eod 1 by
    the eos_token, 400 by name) it passes check_trained_eod, and a GPT2BPETokenizer run keeps its files for --to
    hf. Would catch the import's resume refused with a remedy that would give it another eod."""
    import argparse

    from megatron_lite.checkpointing.megatron_read import megatron_args_to_lite
    from megatron_lite.data.tokenizer import check_trained_eod

    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, padded_vocab_size=512,
                max_position_embeddings=64)
    llama3 = str(files["root"] / "llama3")
    args = megatron_args_to_lite(argparse.Namespace(**base, tokenizer_type="HuggingFaceTokenizer",
                                                    tokenizer_model=llama3, vocab_file=None, merge_file=None))
    check_trained_eod(args, "HuggingFaceTokenizer", llama3, 1, "--load imported")
    gpt2 = {"vocab_file": str(files["root"] / "gpt2" / "vocab.json"),
            "merge_file": str(files["root"] / "gpt2" / "merges.txt")}
    args = megatron_args_to_lite(argparse.Namespace(**base, tokenizer_type="GPT2BPETokenizer", **gpt2))
    assert {key: args.get(key) for key in gpt2} == gpt2


def _merge_loop(parts, ranks):
    """Megatron-LM's BPE loop (gpt2_tokenization.py's bpe), the reference: merge the adjacent pair of lowest
    rank, every occurrence left to right, until no pair is ranked."""
    while len(parts) > 1:
        pair = min(zip(parts, parts[1:]), key=lambda p: ranks.get(p, float("inf")))
        if pair not in ranks:
            return parts
        merged, i = [], 0
        while i < len(parts):
            if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                merged, i = merged + [parts[i] + parts[i + 1]], i + 2
            else:
                merged, i = merged + [parts[i]], i + 1
        parts = merged
    return parts


class _CountingRanks(dict):
    lookups = 0

    def get(self, key, default=None):
        _CountingRanks.lookups += 1
        return super().get(key, default)

    def __contains__(self, key):
        _CountingRanks.lookups += 1
        return super().__contains__(key)


@_needs("tokenizers")
def test_gpt2_bpe_merges_a_long_word_in_about_linear_time(files):
    """A 6000-character run of letters (no space or digit: one pre-tokenized word; DNA, a hash, minified text)
    looks up O(length) pairs, not O(length x merges applied) (Megatron-LM's loop rescans the word after each merge:
    a 32 KB run took 26 s, the `tokenizers` library 14 ms), and gives the ids `tokenizers` gives. The merge order is
    Megatron-LM's loop's on random words under random, scrambled merge ranks. Would catch the rescanning loop
    and a faster merge that picks another order (an overlap 'a a a', a pair created below the current rank)."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatron_lite.data.gpt2_bpe import GPT2BPE, read_merges, read_vocab

    gpt2 = files["root"] / "gpt2"
    bpe = GPT2BPE(read_vocab(str(gpt2 / "vocab.json")), read_merges(str(gpt2 / "merges.txt")))
    rng = random.Random(0)
    letters = [w for w in " ".join(DOCUMENTS).split() if w.isalpha() and w.isascii()]
    word = "".join(rng.choice(letters) for _ in range(1500))[:6000]
    fast = Tokenizer(models.BPE.from_file(str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt")))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert bpe.encode(word) == fast.encode(word).ids
    bpe.ranks = _CountingRanks(bpe.ranks)
    bpe._cache.clear()
    _CountingRanks.lookups = 0
    bpe.encode(word)
    assert _CountingRanks.lookups < 4 * len(word), _CountingRanks.lookups
    for _ in range(2000):
        tokens, ranks = list("abc"), {}
        for _ in range(rng.randint(1, 12)):
            pair = (rng.choice(tokens), rng.choice(tokens))
            ranks.setdefault(pair, len(ranks))
            tokens.append(pair[0] + pair[1])
        order = rng.sample(range(len(ranks)), len(ranks))  # a pair may now rank below the pairs it is made of
        bpe.ranks, bpe._cache = dict(zip(ranks, order)), {}
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 40)))
        assert bpe._bpe(text) == _merge_loop(list(text), bpe.ranks), (text, bpe.ranks)
