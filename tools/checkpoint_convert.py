"""Convert a checkpoint between the two formats, to and from Hugging Face transformers, or export plain model
weights, in one process.

    python tools/checkpoint_convert.py --input runs/a --output runs/a_dist --to torch_dist
    python tools/checkpoint_convert.py --input runs/a_dist --output runs/a_torch --to torch
    python tools/checkpoint_convert.py --input runs/a --export-weights gpt.pt     # torch.load -> GPTModel
    python tools/checkpoint_convert.py --input runs/a --output hf/a --to hf        # from_pretrained("hf/a")
    python tools/checkpoint_convert.py --from hf --input hf/a --output runs/b      # pretrain_gpt.py --finetune
    python tools/checkpoint_convert.py --input runs/a --output runs/a_mlm --to megatron  # Megatron-LM --load
    python tools/checkpoint_convert.py --from megatron --input megatron_save --output runs/c   # --load resumes

`--input` is a --save directory (its newest complete checkpoint, or `--iteration N`); every file is checked
against the checkpoint's manifest first. The formats (megatron_lite/checkpointing/torch_format.py and
torch_dist.py) hold the same state: `torch` one file with full tensors per parameter name, `torch_dist`
1-D tensors per name written through torch.distributed.checkpoint plus common.pt. The output is a new
--save directory with one checkpoint, written atomically; it resumes with --load at any DP size and
sharding strategy. The exported weights are the model's state_dict (full tensors, CPU).

`--to hf` writes a transformers model directory: config.json (GPT2LMHeadModel or LlamaForCausalLM, every
architecture field), model.safetensors with the tokenizer's vocabulary (the padding rows dropped), and the tokenizer
(tokenizer.json, tokenizer_config.json: transformers' AutoTokenizer gives the ids the run trained on, no BOS/EOS
added) for HuggingFaceTokenizer, GPT2BPETokenizer and ByteLevelTokenizer runs (NullTokenizer has no text; for the
SentencePiece types the tool prints the sentencepiece call instead). `--from hf` reads such a directory
(config.json, the shards model.safetensors.index.json names or else every *.safetensors, tokenizer.json if present:
checking them all (megatron_lite/checkpointing/hf_files.py) before anything is written) into a checkpoint of model
weights only at iteration 0, which pretrain_gpt.py starts from with `--finetune --load` and the architecture flags
the tool prints. The mapping: hf_convert.py beside this tool. safetensors (and tokenizers for the tokenizer files)
are the optional `hf` extra.

`--to megatron` writes a Megatron-LM checkpoint directory (megatron_lite/checkpointing/megatron_write.py):
`--megatron-format torch_dist` (megatron-core's dist_checkpointing, Megatron-LM's default) or `torch` (legacy
iter_*/mp_rank_00/model_optim_rng.pt), with the weights, Adam's state, the scheduler (in samples), iteration,
consumed samples and RNG, and prints the Megatron-LM flags that load it.

`--from megatron` reads a Megatron-LM --save directory (its tracker's iteration, or `--iteration N`; torch_dist
or legacy torch, detected) with megatron_lite/checkpointing/megatron_read.py: the weights, and the Adam state,
iteration, consumed samples, learning-rate schedule and RNG where the checkpoint carries them, so that
pretrain_gpt.py --load continues the run; an optimizer state in a form it cannot read is refused with the
remedy, unless `--weights-only` asks for the weights alone (for --finetune).
"""

import argparse
import json
import os
import shutil
import sys
import warnings

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))  # run from a checkout
if TOOLS not in sys.path:  # `python -m tools.checkpoint_convert`: sys.path[0] is the checkout, not tools/
    sys.path.insert(1, TOOLS)

import hf_convert  # noqa: E402  (tools/, beside this file)
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from megatron_lite.checkpointing import (  # noqa: E402
    files,
    hf_files,
    megatron_read,
    megatron_write,
    torch_dist,
    torch_format,
)
from megatron_lite.data import build_tokenizer, gpt2_bpe  # noqa: E402
from megatron_lite.data import tokenizer as lite_tokenizers  # noqa: E402
from megatron_lite.training.initialize import vocab_size_with_padding  # noqa: E402


def read(directory: str) -> dict:
    """Either format -> the `torch` format's payload (full tensors, per parameter name)."""
    files.verify(directory)
    if not torch_dist.is_torch_dist(directory):
        return torch.load(os.path.join(directory, torch_format.CHECKPOINT_FILENAME), map_location="cpu",
                          weights_only=True)
    common = torch_dist.read_common(directory)
    metadata = torch_dist.SafeReader(directory).read_metadata().state_dict_metadata
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in metadata.items()}
    with warnings.catch_warnings():  # one process, no process group: exactly what no_dist is for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=torch_dist.SafeReader(directory), no_dist=True)
    shapes = {name: torch.Size(shape) for name, shape in common["shapes"].items()}
    model, state = {}, {}
    for key, tensor in tensors.items():
        section, rest = key.split(".", 1)
        if section == "model":
            model[rest] = tensor.view(shapes[rest]) if rest in shapes else tensor
        else:
            name, field = rest.rsplit(".", 1)
            state.setdefault(name, {"step": common["optimizer_step"]})[field] = tensor.view(shapes[name])
    return {**{k: common[k] for k in ("iteration", "consumed_train_samples", "opt_param_scheduler", "rng_state",
                                      "args", files.WEIGHTS_ONLY_KEY) if k in common},
            "checkpoint_version": files.CHECKPOINT_VERSION, "model": model,
            "optimizer": {**common["optimizer"], "state": state}}


def write(root: str, payload: dict, ckpt_format: str):
    """`payload` (the `torch` format's) as a new checkpoint in `root`, sealed as save_checkpoint seals one
    (files.new_directory, the files, files.seal_directory), by this one process."""
    iteration = payload["iteration"]
    directory = files.new_directory(root, iteration)
    try:
        if ckpt_format == "torch":
            torch_format.write(directory, payload)
        else:
            _write_torch_dist(directory, payload)
    except BaseException:
        files.discard_directory(directory)
        raise
    files.seal_directory(root, iteration, directory)


def _write_torch_dist(directory: str, payload: dict):
    state = payload["optimizer"]["state"]
    # The parameters (1-D in torch_dist): those with optimizer state, or every tensor of a weights-only checkpoint.
    params = {name: payload["model"][name].shape for name in (state or payload["model"])}
    tensors = {f"model.{k}": (v.reshape(-1) if k in params else v) for k, v in payload["model"].items()}
    tensors.update({f"optimizer.{name}.{field}": value.reshape(-1) for name, entry in state.items()
                    for field, value in entry.items() if field != "step"})
    common = {**{k: payload[k] for k in ("iteration", "consumed_train_samples", "opt_param_scheduler", "rng_state",
                                         "args", files.WEIGHTS_ONLY_KEY) if k in payload},
              "checkpoint_version": files.CHECKPOINT_VERSION, "format": "torch_dist",
              "optimizer": {k: v for k, v in payload["optimizer"].items() if k != "state"},
              "optimizer_step": max([int(e.get("step", 0)) for e in state.values()] + [0]),
              "shapes": {name: list(shape) for name, shape in params.items()}}
    torch.save(common, os.path.join(directory, torch_dist.COMMON_FILENAME))
    with warnings.catch_warnings():  # one process, no process group: exactly what no_dist is for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=directory, no_dist=True)


# ------------------------------------------------------------------------------------------ Megatron-LM
def export_megatron(payload: dict, args):
    """--to megatron: write the Megatron-LM checkpoint and print the Megatron-LM flags that load it."""
    _check_megatron_eod(payload["args"])
    info = megatron_write.export(args.output, payload, args.megatron_format, args.megatron_transformer_impl)
    flags = megatron_write.megatron_flags(payload, args.output, args.megatron_format, args.megatron_transformer_impl,
                                          info["optimizer"])
    carried = "weights, Adam's state, scheduler, iteration" if info["optimizer"] else "the weights only"
    also = "; it loads with --use-distributed-optimizer too" if args.megatron_format == "torch_dist" else ""
    tokenizer = "" if megatron_write.tokenizer_flags(payload["args"]) else "the run's tokenizer, "
    print(f"> wrote iteration {payload['iteration']} as a Megatron-LM {args.megatron_format} checkpoint ({carried}) "
          f"to {args.output}; load it with\n  pretrain_gpt.py {' '.join(flags)}\n  and {tokenizer}--seq-length, "
          f"--micro-batch-size and --train-iters"
          f"{also if info['optimizer'] else ', and the optimizer flags (--lr at least: Megatron-LM has no default)'}")


def _check_megatron_eod(args: dict):
    """Megatron-LM takes a HuggingFaceTokenizer's eod from its eos_token (megatron-core's rule, megatron-lite's
    since 98f4df2): refuse a run that trained with another (saved before, or its tokenizer files changed since)."""
    model = args.get("tokenizer_model")
    if args.get("tokenizer_type") != "HuggingFaceTokenizer" or not model or not os.path.exists(model):
        return  # the printed command names the tokenizer; nothing here to compare
    trained = lite_tokenizers.trained_eod(args, "HuggingFaceTokenizer", model)
    theirs = build_tokenizer("HuggingFaceTokenizer", model)
    if trained is not None and theirs.eos_token is not None and trained != theirs.eod:
        raise ValueError(f"the run trained with eod {trained}, but Megatron-LM would take the eos_token "
                         f"{theirs.eos_token!r} (id {theirs.eod}) that {model}'s tokenizer_config.json / "
                         f"special_tokens_map.json name: give Megatron-LM a copy of its tokenizer.json beside a "
                         f"tokenizer_config.json whose eos_token is the token of id {trained}, if the vocabulary has "
                         f"one (its data and --eod-mask-loss would otherwise mean another token by eod)")


# ------------------------------------------------------------------------------------------ Hugging Face
def _safetensors():
    try:
        import safetensors.torch
    except ImportError as e:
        raise ValueError("--to hf / --from hf need the optional 'safetensors' package: pip install -e \".[hf]\" "
                         "(the Hugging Face extra)") from e
    return safetensors.torch


def check_hf_output(output: str):
    """--to hf writes a new transformers directory: refuse a non-empty `output`, or a file, before any work is
    done."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"--output {output} is a file, not a directory: choose a new directory")
    if os.path.exists(output) and os.listdir(output):
        raise ValueError(f"--output {output} is not empty: choose a new directory")


def export_hf(payload: dict, output: str, tokenizer_type=None, tokenizer_model=None, vocab_size=None,
              vocab_file=None, merge_file=None):
    """Write `payload`'s model as a transformers directory `output` (new or empty). The tokenizer is the one the
    checkpoint records, unless given (checkpoints saved before it was recorded, or tokenizer files moved)."""
    check_hf_output(output)
    safetensors_torch = _safetensors()  # before any conversion work
    args = payload["args"]
    tokenizer_type = tokenizer_type or args.get("tokenizer_type")
    if tokenizer_type is None:
        raise ValueError("the checkpoint does not record its tokenizer (saved by an older version): give "
                         "--tokenizer-type (and --tokenizer-model / --vocab-file / --merge-file / --vocab-size as "
                         "for pretrain_gpt.py)")
    if vocab_size is not None and tokenizer_type != "NullTokenizer":  # build_tokenizer would ignore it
        raise ValueError(f"--vocab-size sets the vocabulary of --tokenizer-type NullTokenizer only; {tokenizer_type} "
                         f"defines its own: drop --vocab-size")
    # A given file flag that the tokenizer would ignore is refused by build_tokenizer; a recorded one counts only
    # for the tokenizer that reads it (older runs recorded --tokenizer-model whatever the type).
    reads = lite_tokenizers.FILE_FLAGS.get(tokenizer_type, ())
    given = {"tokenizer_model": tokenizer_model, "vocab_file": vocab_file, "merge_file": merge_file}
    paths = {k: v or (args.get(k) if k in reads else None) for k, v in given.items()}
    tokenizer = build_tokenizer(tokenizer_type, vocab_size=vocab_size or args.get("vocab_size"), **paths)
    # The exported eos_token_id must be the eod the run trained with (recorded, or by name in older runs).
    lite_tokenizers.check_trained_eod(args, tokenizer_type, paths["tokenizer_model"], tokenizer.eod, "the checkpoint")
    config, tensors = hf_convert.to_hf(payload["model"], args, tokenizer.vocab_size, tokenizer.eod)
    hf_tokenizer_files = None if tokenizer_type == "NullTokenizer" else _hf_tokenizer(tokenizer_type, tokenizer)
    os.makedirs(output, exist_ok=True)
    weights = os.path.join(output, "model.safetensors")
    safetensors_torch.save_file(tensors, weights, metadata={"format": "pt"})
    os.chmod(weights, 0o666 & ~files._umask())  # safetensors creates the file 0600; the other files follow the umask
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if hf_tokenizer_files is not None:
        _write_tokenizer(output, *hf_tokenizer_files, config)
    elif tokenizer_type in lite_tokenizers.SENTENCEPIECE_TYPES:
        print(f"> note: no tokenizer written for {tokenizer_type}: transformers reads a SentencePiece model only "
              f"through protobuf, and its Llama / T5 tokenizers add a BOS token or normalise otherwise. The ids "
              f"training used are sentencepiece.SentencePieceProcessor(model_file={tokenizer.tokenizer_model!r})"
              f".encode(text), eos (= eod) {tokenizer.eod}, no BOS")
    return config


def _hf_tokenizer(tokenizer_type: str, tokenizer):
    """The run's tokenizer as a `tokenizers.Tokenizer` that gives the ids training used (no BOS/EOS added by a
    post-processor), and its end-of-document token; None for a tokenizer transformers cannot take as it is
    (the SentencePiece types). Built before anything is written. ByteLevelTokenizer's is a byte-level BPE without
    merges (id = the byte); GPT2BPETokenizer's the BPE of its vocab.json and merges.txt."""
    if tokenizer_type in lite_tokenizers.SENTENCEPIECE_TYPES:
        return None
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError as e:
        raise ValueError("writing the tokenizer needs the optional 'tokenizers' package: pip install -e \".[hf]\" "
                         "(the Hugging Face extra)") from e
    if tokenizer_type == "ByteLevelTokenizer":
        byte_chars = gpt2_bpe.bytes_to_unicode()
        hf = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
    elif tokenizer_type == "GPT2BPETokenizer":
        ranks = gpt2_bpe.read_merges(tokenizer.merge_file)  # Megatron-LM's reading, ranked as the run merged
        merges = [pair for pair in sorted(ranks, key=ranks.get) if pair]
        hf = Tokenizer(models.BPE(vocab=gpt2_bpe.read_vocab(tokenizer.vocab_file), merges=merges))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
    else:
        hf = Tokenizer.from_file(tokenizer.tokenizer_json)
        # The run tokenized without special tokens: a post-processor adding BOS/EOS (Llama's) would prepend ids
        # the training data never had.
        spec = json.loads(hf.to_str())
        spec["post_processor"] = None
        hf = Tokenizer.from_str(json.dumps(spec))
    eod = hf.id_to_token(tokenizer.eod)
    if eod is None:  # ByteLevelTokenizer's 256, or an id HuggingFaceTokenizer reserved (no end-of-document token)
        eod = "<|endoftext|>"
        hf.add_special_tokens([AddedToken(eod, special=True)])
    elif tokenizer_type == "GPT2BPETokenizer":  # matched in text as the eod id, as the run tokenized it
        hf.add_special_tokens([AddedToken(eod, special=True)])
    if hf.token_to_id(eod) != tokenizer.eod:
        raise ValueError(f"the tokenizer's end-of-document token {eod!r} has id {hf.token_to_id(eod)}, the run's "
                         f"is {tokenizer.eod}")
    return hf, eod


def _write_tokenizer(output: str, hf, eod: str, config: dict):
    """tokenizer.json and tokenizer_config.json giving transformers the ids the run trained on (no BOS/EOS
    added), eod as the bos/eos token."""
    hf.save(os.path.join(output, "tokenizer.json"))
    with open(os.path.join(output, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eod, "eos_token": eod,
                   "add_bos_token": False, "add_eos_token": False,
                   "model_max_length": config.get("n_positions", config.get("max_position_embeddings")),
                   "clean_up_tokenization_spaces": False}, f, indent=2)


def import_hf(directory: str) -> dict:
    """A transformers directory -> the `torch` format's payload of a weights-only checkpoint at iteration 0.
    config.json is compared with the safetensors headers (names, shapes, dtypes) before any tensor is read."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--input {directory} has no config.json: give a transformers model directory")
    config = hf_files.read_json(config_path, "a transformers config.json")
    found, unread = hf_files.headers(directory)
    if unread:
        print(f"> note: {', '.join(unread)} left unread: {hf_files.INDEX} does not name "
              f"{'them' if len(unread) > 1 else 'it'}")
    names = hf_convert.imported_names(config, {name: header.shape for name, header in found.items()})
    args, model = hf_convert.from_hf(config, hf_files.load(found, names))
    return {"checkpoint_version": files.CHECKPOINT_VERSION, "iteration": 0, "consumed_train_samples": 0,
            "model": model, "optimizer": {"state": {}}, "opt_param_scheduler": {}, "rng_state": [], "args": args,
            files.WEIGHTS_ONLY_KEY: f"imported from {os.path.abspath(directory)} by tools/checkpoint_convert.py "
                                    f"--from hf"}


def hf_tokenizer(directory: str, payload: dict):
    """tokenizer.json of `directory`, if it has one, checked (it loads; its vocabulary fits config.json's) before
    anything is written. Returns its path or None."""
    source = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(source):
        return None
    tokenizer = build_tokenizer("HuggingFaceTokenizer", source)
    if vocab_size_with_padding(tokenizer.vocab_size) != payload["args"]["padded_vocab_size"]:
        print(f"> note: {source} has {tokenizer.vocab_size} ids, config.json's vocab_size pads to "
              f"{payload['args']['padded_vocab_size']}: pretrain_gpt.py will refuse it, give another tokenizer")
    return source


def write_imported(output: str, payload: dict, ckpt_format: str, tokenizer) -> list:
    """The imported checkpoint in `output`, with `tokenizer` (hf_tokenizer's) copied next to the checkpoints and
    recorded in it (with the tokenizer_config.json / special_tokens_map.json beside it, which name its eos_token).
    Returns the pretrain_gpt.py flags that read the tokenizer, its path as `output` spells it
    (the checkpoint records the absolute one). The tokenizer is copied only once the checkpoint is written: a
    failed write leaves `output` as it was (a tokenizer.json already there untouched)."""
    created = not os.path.isdir(output)
    os.makedirs(output, exist_ok=True)
    target = os.path.join(output, "tokenizer.json")
    if tokenizer:
        payload["args"].update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=os.path.abspath(target),
                               eod=build_tokenizer("HuggingFaceTokenizer", tokenizer).eod)
    try:
        write(output, payload, ckpt_format)
    except BaseException:
        if created and not os.listdir(output):
            os.rmdir(output)
        raise
    if tokenizer:
        shutil.copyfile(tokenizer, target)
        for name in lite_tokenizers.EOS_FILES:  # they name the eos_token, the eod of HuggingFaceTokenizer
            if os.path.isfile(os.path.join(os.path.dirname(tokenizer), name)):
                shutil.copyfile(os.path.join(os.path.dirname(tokenizer), name), os.path.join(output, name))
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", target] if tokenizer else []


# ------------------------------------------------------------------------------------------ Megatron-LM
def megatron_flags(payload: dict, megatron_args) -> list:
    """pretrain_gpt.py's flags that rebuild the imported run: the architecture (hf_convert.pretrain_flags), the
    tokenizer and dropout and, for a resume, the batch, optimizer and schedule that the checkpoint's state is
    checked against and what fixes the sample order (seed, train and evaluation sizes). ValueError for a run
    megatron-lite cannot continue (reset_position_ids, reset_attention_mask)."""
    flags = hf_convert.pretrain_flags(payload["args"])
    flags += [flag for flag in ("--bf16", "--fp16") if getattr(megatron_args, flag[2:], False)]
    # The run's tokenizer in megatron-lite's terms (NullTokenizer's --vocab-size counts Megatron-LM's eod).
    kind, a = payload["args"].get("tokenizer_type"), payload["args"]
    needed = lite_tokenizers.FILE_FLAGS.get(kind, ()) + (("vocab_size",) if kind == "NullTokenizer" else ())
    if kind in lite_tokenizers.FILE_FLAGS and all(a.get(k) for k in needed):
        flags += ["--tokenizer-type", kind] + [str(f) for k in needed for f in ("--" + k.replace("_", "-"), a[k])]
    # Not left to --model-preset, whose recipe fills what is not given (dropout 0.0; Megatron-LM's default is 0.1).
    flags += [str(f) for k in ("hidden_dropout", "attention_dropout") if a.get(k) is not None
              for f in ("--" + k.replace("_", "-"), a[k])]
    if payload.get(files.WEIGHTS_ONLY_KEY):
        return flags
    if getattr(megatron_args, "legacy_tokenizer", False) and kind == "SentencePieceTokenizer":
        raise ValueError("the checkpoint's args.legacy_tokenizer=True with SentencePieceTokenizer: Megatron-LM's "
                         "legacy class appends <CLS> <SEP> <EOD> <MASK> to the model's pieces and takes <EOD> as eod, "
                         "megatron-lite's (megatron-core's) the model's eos: resumed, the run's eod would change. "
                         "Convert the weights only (--weights-only) and train on with --finetune")
    for key in ("reset_position_ids", "reset_attention_mask"):
        if getattr(megatron_args, key, False):
            raise ValueError(f"the checkpoint's args.{key}=True: megatron-lite's GPT batches have no --"
                             f"{key.replace('_', '-')} (the loss would change): convert the weights only "
                             f"(--weights-only)")
    # megatron-lite's samples are megatron-core's GPTDataset in MegatronPretrainingSampler's order (Megatron-LM's
    # default --dataloader-type single): another dataset or order would go on with other samples.
    for key, value in (("dataloader_type", "single"), ("fim_data", False), ("sft", False)):
        if getattr(megatron_args, key, value) not in (value, None):
            raise ValueError(f"the checkpoint's args.{key}={getattr(megatron_args, key)!r}: megatron-lite reads "
                             f"GPTDataset's samples in Megatron-LM's --dataloader-type single order only (resumed, "
                             f"the run would train on other samples): convert the weights only (--weights-only)")
    flags += [f"--{k.replace('_', '-')}" for k in ("eod_mask_loss", "calculate_per_token_loss")
              if getattr(megatron_args, k, False)]
    schedule, groups = payload["opt_param_scheduler"], payload["optimizer"]["param_groups"]
    group = next((g for g in groups if g["wd_mult"] == 1.0), groups[0])  # the weight-decayed parameters' group
    pairs = [("--seq-length", getattr(megatron_args, "seq_length", None)),
             ("--global-batch-size", megatron_read.global_batch_size(megatron_args, payload["iteration"]))]
    if schedule:
        pairs += [("--lr", schedule["max_lr"]), ("--min-lr", schedule["min_lr"]),
                  ("--lr-decay-style", schedule["lr_decay_style"]), ("--lr-warmup-iters", schedule["lr_warmup_steps"]),
                  ("--lr-decay-iters", schedule["lr_decay_steps"])]
    pairs += [("--weight-decay", group["weight_decay"]), ("--adam-beta1", group["betas"][0]),
              ("--adam-beta2", group["betas"][1]), ("--adam-eps", group["eps"]),
              ("--clip-grad", getattr(megatron_args, "clip_grad", None)),
              # The sample order: megatron-core's datasets are built for train_iters x batch samples (and the
              # evaluations'), shuffled by the seed; the same values continue on Megatron-LM's next samples.
              ("--seed", getattr(megatron_args, "seed", None)),
              ("--train-iters", getattr(megatron_args, "train_iters", None)),
              ("--eval-interval", getattr(megatron_args, "eval_interval", None)),
              ("--eval-iters", getattr(megatron_args, "eval_iters", None))]
    return flags + [str(f) for flag, value in pairs if value is not None for f in (flag, value)]


def import_megatron(p, args):
    """--from megatron: read, write, print the command that continues."""
    try:
        payload, megatron_args = megatron_read.read_megatron(args.input, args.iteration, args.weights_only)
        _, directory, fmt = megatron_read.find_checkpoint(args.input, args.iteration)
        flags = " ".join(megatron_flags(payload, megatron_args))
    except megatron_read.OptimizerStateUnreadable as e:
        p.error(f"{e}\n(the weights are readable: --weights-only converts them alone)")
    except ValueError as e:
        p.error(str(e))
    write(args.output, payload, args.to)
    what = "the weights" if args.weights_only else f"iteration {payload['iteration']} (weights, optimizer state, " \
                                                    f"schedule, RNG)"
    load = "--finetune --load" if args.weights_only else "--load"
    print(f"> wrote {what} of Megatron-LM's {fmt} checkpoint {directory} as {args.to} to {args.output}; "
          f"{'train from' if args.weights_only else 'continue'} with\n  pretrain_gpt.py {load} {args.output} "
          f"{flags} (and the run's data flags{'' if '--tokenizer-type' in flags else ' and tokenizer flags'})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="a --save directory (with --from hf: a transformers directory)")
    p.add_argument("--iteration", type=int, help="which checkpoint (default: the newest complete one)")
    p.add_argument("--output", help="a new --save directory for the converted checkpoint (--to hf: a new "
                                    "transformers directory)")
    p.add_argument("--to", choices=["torch", "torch_dist", "hf", "megatron"],
                   help="the output format (with --from hf / --from megatron: torch or torch_dist, default torch)")
    p.add_argument("--from", dest="source", choices=["hf", "megatron"],
                   help="read --input as a transformers directory (hf) or a Megatron-LM --save directory (megatron)")
    p.add_argument("--weights-only", action="store_true", help="--from megatron: convert the model weights alone "
                                                               "(for pretrain_gpt.py --finetune)")
    p.add_argument("--export-weights", metavar="FILE", help="write the model's state_dict to FILE (torch.save)")
    m = p.add_argument_group("--to megatron: a Megatron-LM checkpoint (megatron_lite/checkpointing/megatron_write.py)")
    m.add_argument("--megatron-format", choices=list(megatron_write.FORMATS),
                   help="Megatron-LM's --ckpt-format: torch_dist (its default; loads with and without "
                        "--use-distributed-optimizer) or torch (legacy mp_rank_00 files; without it)")
    m.add_argument("--megatron-transformer-impl", choices=list(megatron_write.TRANSFORMER_IMPLS),
                   help="Megatron-LM's --transformer-impl that loads it, in the printed flags (default "
                   "Megatron-LM's, transformer_engine); legacy torch writes its parameter names (torch_dist loads "
                   "with either)")
    g = p.add_argument_group("--to hf: the run's tokenizer where the checkpoint does not record it (pretrain_gpt.py's)")
    g.add_argument("--tokenizer-type", choices=lite_tokenizers.TOKENIZER_TYPES)
    lite_tokenizers.add_tokenizer_file_arguments(g)
    g.add_argument("--vocab-size", type=int, help="vocabulary of NullTokenizer")
    args = p.parse_args(argv)
    for dest in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size"):
        if getattr(args, dest) is not None and args.to != "hf":  # the other conversions keep the recorded tokenizer
            p.error(f"--{dest.replace('_', '-')} is read by --to hf only (the exported run's tokenizer): drop it")
    if args.source == "hf":
        args.to = args.to or "torch"
        if args.to == "hf" or args.export_weights or args.iteration is not None or not args.output:
            p.error("--from hf takes --input DIR --output SAVE_DIR [--to torch|torch_dist]")
    if args.source == "megatron":
        args.to = args.to or "torch"
        if args.to not in ("torch", "torch_dist") or args.export_weights or not args.output:
            p.error("--from megatron takes --input MEGATRON_SAVE --output SAVE [--iteration N] [--weights-only] "
                    "[--to torch|torch_dist]")
    elif args.weights_only:
        p.error("--weights-only goes with --from megatron")
    if bool(args.output) != bool(args.to) or not (args.output or args.export_weights):
        p.error("give --output with --to, and/or --export-weights")
    if args.output and os.path.exists(args.output) and not os.path.isdir(args.output):
        p.error(f"--output {args.output} is a file, not a directory: choose a new directory")
    if args.output and os.path.isdir(args.output) and files.complete_checkpoints(args.output):
        p.error(f"--output {args.output} already holds checkpoints: choose a new directory")
    if args.to != "megatron" and (args.megatron_format or args.megatron_transformer_impl):
        p.error("--megatron-format and --megatron-transformer-impl need --to megatron")
    if args.to == "megatron":
        args.megatron_format = args.megatron_format or "torch_dist"
        args.megatron_transformer_impl = args.megatron_transformer_impl or "transformer_engine"
        if os.path.lexists(args.output):
            p.error(f"--output {args.output} exists: choose a new directory")
    if args.to == "hf":
        try:
            check_hf_output(args.output)  # before the checkpoint is read
        except ValueError as e:
            p.error(str(e))
    if args.source == "hf":
        try:
            payload = import_hf(args.input)
            tokenizer = hf_tokenizer(args.input, payload)
        except ValueError as e:
            p.error(str(e))
        tokenizer_flags = write_imported(args.output, payload, args.to, tokenizer)
        flags = hf_convert.pretrain_flags(payload["args"]) + tokenizer_flags
        print(f"> wrote the weights of {args.input} as {args.to} to {args.output}; train from them with\n"
              f"  pretrain_gpt.py --finetune --load {args.output} {' '.join(flags)}")
        return
    if args.source == "megatron":
        return import_megatron(p, args)
    try:
        if args.iteration is None:
            iteration, directory = files.find_latest(args.input)
        else:
            iteration, directory = args.iteration, files.checkpoint_dir(args.input, args.iteration)
        if iteration is None or not os.path.isdir(directory):
            p.error(f"--input {args.input} holds no such checkpoint")
        payload = read(directory)
    except ValueError as e:
        p.error(str(e))
    if "expert_parallel" in payload:  # per-position experts: not expressible in torch_dist or plain weights yet
        p.error(f"--input {args.input} holds expert parameters (one set per expert-parallel position): converting "
                f"or exporting them is not supported yet")
    if args.to == "megatron":
        try:
            export_megatron(payload, args)
        except ValueError as e:
            p.error(str(e))
    elif args.to == "hf":
        try:
            config = export_hf(payload, args.output, args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                               args.vocab_file, args.merge_file)
        except ValueError as e:
            p.error(str(e))
        print(f"> wrote iteration {payload['iteration']} as a transformers {config['architectures'][0]} to "
              f"{args.output}")
    elif args.output:
        write(args.output, payload, args.to)
        print(f"> wrote iteration {payload['iteration']} as {args.to} to {args.output}")
    if args.export_weights:
        torch.save({k: v.contiguous() for k, v in payload["model"].items()}, args.export_weights)
        print(f"> wrote the model weights of iteration {payload['iteration']} to {args.export_weights}")


if __name__ == "__main__":
    main()
