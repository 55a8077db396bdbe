"""The data flags of pretrain_gpt.py, spelled and defaulted like Megatron-LM's, and what they build.

    --data-path [W] PREFIX ...          one distribution (blend), cut into train/valid/test by --split
    --train-data-path / --valid-data-path / --test-data-path [W] PREFIX ...   one blend per split
    --split, --seed, --seq-length       megatron-core's document split, shuffles and sample windows
    --data-cache-path                   where the index arrays are cached (and the built-in corpus)
    --num-workers                       DataLoader worker processes per rank

`train_valid_test_num_samples` asks for as many samples as Megatron-LM does, which fixes the number of
epochs and so the sample order (docs/pretrain_gpt.md, "Coming from Megatron-LM").
"""

import argparse
import os

from ..config_checks import Check, check_fields
from ..data import GPTDatasetConfig, get_blend_from_list, parse_split
from ..data.blended_megatron_dataset_builder import PER_SPLIT_FLAGS
from ..data.tokenizer import TOKENIZER_TYPES, add_tokenizer_file_arguments, check_tokenizer_flags

PER_SPLIT = ("train_data_path", "valid_data_path", "test_data_path")


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="synthetic, learnable sequences instead of a dataset")
    g.add_argument("--data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                   help="dataset prefix(es) made by tools/preprocess_data.py or Megatron-LM's preprocessing: one "
                        "PREFIX, or PREFIX1 PREFIX2 ... (blended in proportion to their sizes), or WEIGHT1 PREFIX1 "
                        "WEIGHT2 PREFIX2 ... (blended by weight); each is cut into train/valid/test by --split "
                        "(default: the built-in corpus, built on first use)")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                       help=f"the {split} split's own dataset(s), in --data-path's form, instead of --data-path "
                            "and --split" + (" (--train-data-path is required with them)" if split != "train" else ""))
    g.add_argument("--split", default="969,30,1",
                   help="train,valid,test weights of each --data-path dataset's documents: 1 to 3 non-negative numbers "
                        "separated by ',' or '/', missing ones 0, the train weight positive; split i is documents "
                        "[round(begin_i x n), round(end_i x n)) as in megatron-core")
    g.add_argument("--data-cache-path", default=os.path.join("data", "cache"),
                   help="directory for the dataset index caches (named by a hash of what they depend on, reused by "
                        "later runs) and the built-in corpus (default: data/cache; Megatron's: next to each dataset)")
    g.add_argument("--num-workers", type=int, default=0,
                   help="DataLoader worker processes per rank that read samples ahead (the same batches as 0; "
                        "Megatron's default is 2, here 0: on CPU the workers compete with the ranks for cores)")
    g.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                   help="fraction of extra samples each blended dataset is built with, so the blend never runs one "
                        "dry (megatron-core's)")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer", choices=TOKENIZER_TYPES,
                   help="how text was turned into token ids, by Megatron's names (must match "
                        "tools/preprocess_data.py); it gives the vocabulary size and the end-of-document id")
    add_tokenizer_file_arguments(g)
    g.add_argument("--vocab-size", type=int,
                   help="vocabulary of --tokenizer-type NullTokenizer, >= 2 (use it with --mock-data for a custom "
                        "size); the other tokenizers define their own")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss on the token that follows an end-of-document token (Megatron's loss mask)")


def uses_dataset_files(args) -> bool:
    return bool(args.data_path) or any(getattr(args, name) for name in PER_SPLIT)


def check_data_args(args):
    """The data flags that would otherwise fail only once the process group and the datasets exist: the
    blends and their files, --split, --num-workers, --vocab-size against --tokenizer-type, --seed. Sets
    args.blend and args.blend_per_split. Raises ValueError naming the flag."""
    check_fields(args, _SOURCE_RULES)
    args.blend = get_blend_from_list(args.data_path, "--data-path")
    args.blend_per_split = [get_blend_from_list(getattr(args, name), flag)
                            for name, flag in zip(PER_SPLIT, PER_SPLIT_FLAGS)] if _per_split(args) else None
    for flag, blend in [("--data-path", args.blend)] + list(zip(PER_SPLIT_FLAGS, args.blend_per_split or [])):
        for prefix in (blend or ([],))[0]:
            for path in (prefix + ".idx", prefix + ".bin"):
                if not os.path.isfile(path):
                    raise ValueError(f"{flag} {prefix}: no such file {path} (give the prefix without .bin/.idx; "
                                     "Megatron-LM's preprocessing names it OUTPUT_PREFIX_text_document)")
    parse_split(args.split)  # the data code's own parser: it accepts exactly the --split values a run accepts
    check_fields(args, _LOADER_RULES)
    # At parse time, before any process starts: a missing or ignored --tokenizer-model / --vocab-file / --merge-file.
    check_tokenizer_flags(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    check_fields(args, _TOKENIZER_RULES)


def _per_split(args) -> bool:
    return any(getattr(args, name) for name in PER_SPLIT)


# check_data_args's checks, in the order it runs them (megatron_lite/config_checks.py).
_SOURCE_RULES = ((None, (
    Check(lambda a: not (a.mock_data and uses_dataset_files(a)),
          "--mock-data and --data-path (or --train-data-path ...) are mutually exclusive"),
    Check(lambda a: not (a.data_path and _per_split(a)),
          "--data-path and --train-data-path / --valid-data-path / --test-data-path are mutually exclusive: give "
          "one distribution cut by --split, or one per split"),
    Check(lambda a: not _per_split(a) or a.train_data_path,
          "--valid-data-path / --test-data-path need --train-data-path"),
)),)
_LOADER_RULES = (
    ("num_workers", (Check(lambda v: not v < 0, "{flag} must be >= 0, got {value}"),)),
    ("mid_level_dataset_surplus", (Check(lambda v: v >= 0, "{flag} must be >= 0, got {value}"),)),
    ("vocab_size", (Check(lambda v: v is None or not v < 2,
                          "{flag} must be an integer >= 2 (NullTokenizer's eod takes the last id), got {value}"),)),
    # silently ignoring it would build another model than asked
    (None, (Check(lambda a: a.vocab_size is None or a.tokenizer_type == "NullTokenizer",
                  "--vocab-size sets the vocabulary of --tokenizer-type NullTokenizer only; {config.tokenizer_type} "
                  "defines its own: drop --vocab-size or add --tokenizer-type NullTokenizer"),)),
)
_TOKENIZER_RULES = (
    (None, (
        Check(lambda a: a.tokenizer_type != "NullTokenizer" or a.vocab_size is not None,
              "--tokenizer-type NullTokenizer needs --vocab-size"),
        Check(lambda a: a.tokenizer_type != "NullTokenizer" or a.mock_data or uses_dataset_files(a),
              "--tokenizer-type NullTokenizer cannot tokenize the built-in corpus: add --mock-data, or --data-path "
              "to a dataset of token ids below --vocab-size"),
    )),
    # torch.manual_seed's range, non-negative for numpy's shuffling
    ("seed", (Check(lambda v: 0 <= v < 2 ** 64, "{flag} must be an integer in [0, 2**64), got {value}"),)),
    # numpy.random.RandomState, megatron-core's shuffles
    (None, (Check(lambda a: a.seed < 2 ** 32 or a.mock_data,
                  "--seed must be below 2**32 to shuffle a dataset (numpy's RandomState), got {config.seed}"),)),
)


def gpt_dataset_config_from_args(args, tokenizer, builtin_prefix=None) -> GPTDatasetConfig:
    """megatron-core's core_gpt_dataset_config_from_args; `builtin_prefix` stands in for --data-path when
    no data flag is given."""
    blend = args.blend if args.blend is not None or args.blend_per_split else ([builtin_prefix], None)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=args.blend_per_split,
        split=args.split if blend is not None else None, path_to_cache=args.data_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus, eod_mask_loss=args.eod_mask_loss,
        eod=tokenizer.eod, vocab_size=tokenizer.vocab_size)


def train_valid_test_num_samples(args):
    """Samples per split as Megatron-LM asks for them: train_iters x global batch, the validation batches of
    every evaluation (train_iters // eval_interval + 1 of them), one evaluation's worth of test batches."""
    evaluations = args.train_iters // args.eval_interval + 1
    return (args.train_iters * args.global_batch_size, evaluations * args.eval_iters * args.global_batch_size,
            args.eval_iters * args.global_batch_size)
