"""Compare pretrain_gpt.py's datasets with megatron-core's for the same data flags (outside the test suite).

    PYTHONPATH=/tmp/mcore/pkg python tests/data/compare_megatron_datasets.py               # the built-in corpus
    PYTHONPATH=/tmp/mcore/pkg python tests/data/compare_megatron_datasets.py --data-path 0.3 A 0.7 B --seed 42

(megatron-core from its wheel, as in pin_megatron_samples.py.) The arguments are pretrain_gpt.py's; the
script builds megatron-lite's train/valid/test datasets as pretrain_gpt.py does, and megatron-core's with
BlendedMegatronDatasetBuilder for the same blend(s), split, seed, sequence length and sample counts, then
reports per split whether every index array (document, sample, shuffle, blending) is equal in value and
dtype and whether the first 320 samples hold the same tokens and labels. Exit status 1 when anything differs.
"""

import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_lite.data import build_datasets, build_tokenizer, ensure_builtin_dataset  # noqa: E402
from megatron_lite.training import parse_args  # noqa: E402
from megatron_lite.training.data_arguments import (  # noqa: E402
    gpt_dataset_config_from_args,
    train_valid_test_num_samples,
    uses_dataset_files,
)


def index_arrays(dataset):
    """Every index array of a dataset (a blend's, then its datasets'), in a fixed order."""
    if hasattr(dataset, "dataset_index"):
        arrays = [dataset.dataset_index, dataset.dataset_sample_index]
        return arrays + [a for inner in dataset.datasets for a in index_arrays(inner)]
    return [dataset.document_index, dataset.sample_index, dataset.shuffle_index]


def main(argv):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    tmp = tempfile.mkdtemp(prefix="compare_megatron_")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
    args = parse_args(argv + ["--data-cache-path", os.path.join(tmp, "lite")], world_size=1)
    tokenizer = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                                vocab_file=args.vocab_file, merge_file=args.merge_file)
    builtin = None if uses_dataset_files(args) else ensure_builtin_dataset(os.path.join("data", "cache"), tokenizer)
    sizes = train_valid_test_num_samples(args)
    config = gpt_dataset_config_from_args(args, tokenizer, builtin)
    ours = build_datasets(config, sizes)

    class Tokenizer:  # what megatron-core's GPTDataset asks of a tokenizer
        vocab_size, eod, unique_identifiers = tokenizer.vocab_size, tokenizer.eod, {"class": "compare"}

    theirs = BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=config.blend,
        blend_per_split=config.blend_per_split, split=config.split, path_to_cache=os.path.join(tmp, "mcore"),
        tokenizer=Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=args.eod_mask_loss, mid_level_dataset_surplus=args.mid_level_dataset_surplus)).build()
    print(f"samples asked for (train, valid, test): {sizes}")
    same = True
    for name, a, b in zip(("train", "valid", "test"), ours, theirs):
        if a is None or b is None:
            print(f"{name}: megatron-lite {type(a).__name__}, megatron-core {type(b).__name__}")
            same &= a is None and b is None
            continue
        mine, core = index_arrays(a), index_arrays(b)
        arrays_equal = len(mine) == len(core) and all(
            x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(mine, core))
        n = min(320, len(a), len(b))
        samples_equal = all(torch.equal(a[i]["tokens"], b[i]["tokens"]) and torch.equal(a[i]["labels"], b[i]["labels"])
                            for i in range(n))
        print(f"{name}: {len(a)} / {len(b)} samples; index arrays equal: {arrays_equal} "
              f"({sum(x.size for x in mine)} elements); first {n} samples equal: {samples_equal}")
        same &= len(a) == len(b) and arrays_equal and samples_equal
    torch.distributed.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
