"""Blends, the index cache, DataLoader workers and the data flags (the order itself: test_megatron_order.py).

Single process except the two-rank cache and training tests; CPU, a few seconds in all.
"""

import os
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from distributed_helper import run_distributed
from pretrain_testing import REPO, tiny_pretrain_flags

from megatron_lite.data import (
    BlendedDataset,
    GPTDatasetConfig,
    IndexedDatasetBuilder,
    build_datasets,
    get_blend_from_list,
    micro_batch_iterator,
)
from megatron_lite.training import build_parser, validate_args


def write_corpus(prefix, num_docs, seed, vocab_size=500):
    rng = np.random.RandomState(seed)
    with IndexedDatasetBuilder(str(prefix), vocab_size) as builder:
        for _ in range(num_docs):
            builder.add_document(rng.randint(0, vocab_size - 1, size=rng.randint(5, 80)).tolist() + [vocab_size - 1])
    return str(prefix)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blend")
    return write_corpus(tmp / "A", 40, 0), write_corpus(tmp / "B", 25, 1), write_corpus(tmp / "C", 60, 2)


def config(blend, cache=None, **kw):
    return GPTDatasetConfig(random_seed=1234, sequence_length=16, blend=blend, split="90,8,2", path_to_cache=cache,
                            **kw)


def test_blend_proportions_over_10k_samples(corpora):
    """Would catch weights not normalized, applied to the wrong dataset, or a blend that drifts from its
    proportions (each within 1% over 10k samples), and contributing datasets built without megatron-core's
    margin (ceil(ceil(n w) x 1.005) samples) that the blend then overruns."""
    train, valid, test = build_datasets(config((list(corpora), [2.0, 5.0, 3.0])), [10000, 500, 100])
    assert isinstance(train, BlendedDataset) and len(train) >= 10000
    shares = np.bincount(np.asarray(train.dataset_index[:10000]), minlength=3) / 10000
    assert np.all(np.abs(shares - [0.2, 0.5, 0.3]) < 0.01), shares
    for dataset, weight in zip(train.datasets, (0.2, 0.5, 0.3)):
        assert dataset.num_samples_requested == int(np.ceil(np.ceil(10000 * weight) * 1.005))
    for i in (0, 1, 9999):  # a sample is the contributing dataset's sample
        source, k = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        assert torch.equal(train[i]["tokens"], train.datasets[source][k]["tokens"])
    assert len(valid) >= 500 and len(test) >= 100


def test_unweighted_blend_takes_the_datasets_sizes(corpora):
    """Would catch an unweighted --data-path list blended equally instead of by size (one epoch each)."""
    train = build_datasets(config((list(corpora[:2]), None)), [50, 10, 10])[0]
    lengths = [len(d) for d in train.datasets]
    assert len(train) == 50 and train.weights == pytest.approx(np.array(lengths) / sum(lengths))
    everything = build_datasets(config((list(corpora[:2]), None)), [10**6, 10, 10])[0]
    assert len(everything) == sum(lengths)  # capped at one epoch of each (megatron-core's rule)


def cache_files(cache):
    return {name: os.stat(os.path.join(cache, name)).st_mtime_ns for name in sorted(os.listdir(cache))}


def test_index_cache_is_reused(corpora, tmp_path):
    """Would catch a second run rebuilding (or rewriting) the indices, a cache named by something else than
    what the indices depend on (another seed must not hit), and loaded indices that differ from built ones."""
    cache = str(tmp_path / "cache")
    first = build_datasets(config((list(corpora), [0.3, 0.3, 0.4]), cache), [300, 30, 10])
    files = cache_files(cache)
    assert not any(d.cache_hit for d in first) and not any(d.cache_hit for d in first[0].datasets)
    assert len(files) == 3 * (4 + 3 * 5)  # per split: blend (description, digests + 2), 3 datasets (... + 3)
    assert all(name.split("-")[1] in ("GPTDataset", "BlendedDataset") for name in files)
    second = build_datasets(config((list(corpora), [0.3, 0.3, 0.4]), cache), [300, 30, 10])
    assert all(d.cache_hit for d in second) and all(d.cache_hit for d in second[0].datasets)
    assert cache_files(cache) == files  # nothing rewritten
    for i in range(0, 300, 7):
        assert torch.equal(first[0][i]["tokens"], second[0][i]["tokens"])
    other_seed = GPTDatasetConfig(random_seed=5, sequence_length=16, blend=([corpora[0]], None), split="90,8,2",
                                  path_to_cache=cache)
    assert not build_datasets(other_seed, [300, 30, 10])[0].cache_hit


def _train_base(cache):
    """The common start of the train GPTDataset's cache files' names in `cache`."""
    description = [n for n in os.listdir(cache) if "-GPTDataset-train-" in n and n.endswith("description.txt")][0]
    return description[:-len("description.txt")]


@pytest.mark.parametrize("damage", ["truncate", "description", "wrong_array", "other_configuration", "in_range",
                                    "no_digests"])
def test_damaged_cache_is_rebuilt_with_a_warning(corpora, tmp_path, damage):
    """Would catch a truncated .npy crashing every later run, a cache whose description does not match
    being trusted, arrays of another shape (another corpus under the same name) read as samples, the arrays of
    another configuration (--seed 5: the same shapes, every value in range) copied under this one's names and
    trained on as its sample order without a word, a sample_index damaged in place with in-range values (a
    sample of another length: `stack expects each tensor to be equal size` at the first batch holding it), and
    a set without its digests (an older cache, a partial copy) trusted unverified."""
    cache = str(tmp_path / "cache")
    reference = build_datasets(config(([corpora[0]], None), cache), [200, 20, 5])[0]
    expected = [reference[i]["tokens"] for i in range(0, 200, 9)]
    base = _train_base(cache)
    if damage == "other_configuration":
        other = str(tmp_path / "other")
        build_datasets(GPTDatasetConfig(random_seed=5, sequence_length=16, blend=([corpora[0]], None),
                                        split="90,8,2", path_to_cache=other), [200, 20, 5])
        other_base = _train_base(other)
        for name in ("document_index.npy", "sample_index.npy", "shuffle_index.npy"):
            mine, theirs = np.load(os.path.join(cache, base + name)), np.load(os.path.join(other, other_base + name))
            assert mine.shape == theirs.shape and not np.array_equal(mine, theirs)
            shutil.copyfile(os.path.join(other, other_base + name), os.path.join(cache, base + name))
    elif damage == "in_range":
        path = os.path.join(cache, base + "sample_index.npy")
        sample_index = np.load(path)
        sample_index[5, 1] += 3  # still inside its document
        np.save(path, sample_index)
    elif damage == "no_digests":
        os.remove(os.path.join(cache, base + "digests.json"))
    elif damage == "truncate":
        path = os.path.join(cache, base + "sample_index.npy")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif damage == "description":
        with open(os.path.join(cache, base + "description.txt"), "a") as f:
            f.write(" ")
    else:
        np.save(os.path.join(cache, base + "shuffle_index.npy"), np.arange(7, dtype=np.uint32))
    with pytest.warns(UserWarning, match="unusable .*rebuilding"):
        rebuilt = build_datasets(config(([corpora[0]], None), cache), [200, 20, 5])[0]
    assert not rebuilt.cache_hit
    assert all(torch.equal(a, rebuilt[i]["tokens"]) for a, i in zip(expected, range(0, 200, 9)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # repaired: the next build loads it silently
        assert build_datasets(config(([corpora[0]], None), cache), [200, 20, 5])[0].cache_hit


def test_an_unchanged_cache_loads_without_reading_its_arrays(corpora, tmp_path, monkeypatch):
    """A set whose files are the ones its digests were taken of (same size, mtime and inode, older than the
    digests file) loads without hashing its arrays; another configuration's arrays copied over them with
    their times (shutil.copy2) or moved into their place are still hashed and refused. Would catch a load that
    reads every array in full (each rank, each start: GBs at Megatron's scale, where the memory maps are read
    only where sampled), or a cheap check that a copy keeping the file times slips past."""
    from megatron_lite.data import index_cache

    cache, other = str(tmp_path / "cache"), str(tmp_path / "other")
    build_datasets(config(([corpora[0]], None), cache), [200, 20, 5])
    build_datasets(GPTDatasetConfig(random_seed=5, sequence_length=16, blend=([corpora[0]], None), split="90,8,2",
                                    path_to_cache=other), [200, 20, 5])
    for name in os.listdir(cache):  # as for a cache whose build (hashing GBs) took longer than a clock tick
        if name.endswith("digests.json"):
            later = os.stat(os.path.join(cache, name)).st_mtime_ns + 10**10
            os.utime(os.path.join(cache, name), ns=(later, later))
    hashed = []
    real_sha256 = index_cache._sha256
    monkeypatch.setattr(index_cache, "_sha256", lambda path: hashed.append(path) or real_sha256(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build_datasets(config(([corpora[0]], None), cache), [200, 20, 5])[0].cache_hit
    assert [path for path in hashed if path.endswith(".npy")] == []
    base, other_base = _train_base(cache), _train_base(other)
    theirs, mine = os.path.join(other, other_base + "sample_index.npy"), os.path.join(cache, base + "sample_index.npy")
    earlier = os.stat(mine).st_mtime_ns - 10**9  # written a second before ours (not in the same clock tick)
    os.utime(theirs, ns=(earlier, earlier))
    shutil.copy2(theirs, mine)  # in place (the same inode) and with its times
    with pytest.warns(UserWarning, match="sample_index.npy is not the file written with this description"):
        assert not build_datasets(config(([corpora[0]], None), cache), [200, 20, 5])[0].cache_hit
    os.replace(os.path.join(other, other_base + "shuffle_index.npy"), os.path.join(cache, base + "shuffle_index.npy"))
    with pytest.warns(UserWarning, match="shuffle_index.npy is not the file written with this description"):
        assert not build_datasets(config(([corpora[0]], None), cache), [200, 20, 5])[0].cache_hit


def test_unwritable_cache_is_a_clear_error(corpora, tmp_path):
    """Would catch an OSError traceback from deep inside numpy instead of a message naming the flag."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="--data-cache-path .*cannot write"):
        build_datasets(config(([corpora[0]], None), str(blocker / "cache")), [10, 2, 2])


def _build_on_ranks(blend, cache):
    from megatron_lite.distributed import collectives

    datasets = collectives.rank_zero_first(build_datasets, config(blend, cache), [120, 12, 4])
    train = datasets[0]
    return [d.cache_hit for d in train.datasets], [train[i]["tokens"].tolist() for i in range(0, 120, 11)]


def test_ranks_started_together_build_once(corpora, tmp_path):
    """Would catch every rank building (and writing) the indices at once, or ranks that end up with
    different samples: rank 0 builds while rank 1 waits, then rank 1 loads rank 0's cache."""
    results = run_distributed(_build_on_ranks, 2, (list(corpora[:2]), [0.5, 0.5]), str(tmp_path / "cache"))
    (hits0, samples0), (hits1, samples1) = results
    assert hits0 == [False, False] and hits1 == [True, True]
    assert samples0 == samples1


def test_num_workers_give_the_same_batches(corpora):
    """Would catch DataLoader workers reading other samples, in another order, or another rank's share."""
    train = build_datasets(config((list(corpora), [1.0, 1.0, 2.0])), [200, 20, 5])[0]
    for rank in (0, 1):
        plain = micro_batch_iterator(train, 16, 3, rank, 2, num_workers=0)
        workers = micro_batch_iterator(train, 16, 3, rank, 2, num_workers=2)
        for _ in range(8):
            a, b = next(plain), next(workers)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pretrain_with_a_weighted_blend_and_workers(corpora, tmp_path):
    """Would catch --data-path weights or --num-workers not reaching the training loop: pretrain_gpt.py trains
    on a 0.3 / 0.7 blend with and without DataLoader workers (two runs side by side) and logs the same losses."""
    argv = tiny_pretrain_flags(mock_data=None, train_iters="4", log_interval="1", eval_iters="1", eval_interval="2",
                               tokenizer_type="NullTokenizer", vocab_size="500", data_cache_path=str(tmp_path))
    argv += ["--data-path", "0.3", corpora[0], "0.7", corpora[1]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [subprocess.Popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py")] + argv + extra, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for extra in ([], ["--num-workers", "2"])]
    outputs = [run.communicate(timeout=240)[0] for run in runs]
    assert all(run.returncode == 0 for run in runs), outputs
    losses = [re.findall(r"\| lm loss: (\S+) \|", out) for out in outputs]
    assert len(losses[0]) == 4 and losses[0] == losses[1], outputs
    assert "> train: " in outputs[0] and "(BlendedDataset" in outputs[0]


def test_start_up_lines_name_the_blend_weights_and_a_split_left_out(tmp_path, single_rank_group, capsys):
    """--data-path 0.3 A 0.7 B --split 90,8,2 where each dataset's test document holds one token. Would catch
    the blend's weights missing from the dataset lines (a user cannot see what the run mixes), and the test
    split dropped without a word (it is too small for one sample)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt

    prefixes = []
    for name, seed in (("A", 0), ("B", 1)):
        prefix, rng = str(tmp_path / name), np.random.RandomState(seed)
        with IndexedDatasetBuilder(prefix, 500) as builder:  # documents 0..49 of 5-80 tokens, 50 of one
            for _ in range(50):
                builder.add_document(rng.randint(0, 499, size=rng.randint(5, 80)).tolist() + [499])
            builder.add_document([499])
        prefixes.append(prefix)
    argv = tiny_pretrain_flags(mock_data=None, train_iters="2", eval_iters="1", eval_interval="2", split="90,8,2",
                               tokenizer_type="NullTokenizer", vocab_size="500", data_cache_path=str(tmp_path / "c"))
    pretrain_gpt.main(argv + ["--data-path", "0.3", prefixes[0], "0.7", prefixes[1]], world_size=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("> train", "> valid",
                                                                                        "> test"))]
    assert len(lines) == 3, lines
    for line in lines[:2]:
        assert f"(BlendedDataset of 0.3 {prefixes[0]}, 0.7 {prefixes[1]}, index built into" in line, line
    assert lines[2] == (f"> test: none (test split too small for --seq-length 32: documents 50..50 of {prefixes[0]} "
                        "hold 1 tokens)"), lines[2]


@pytest.mark.parametrize("argv, message", [
    (["--data-path", "0.3", "A", "0.7"], "--data-path .*3 values, but weights and prefixes must come in pairs"),
    (["--data-path", "-0.3", "A", "0.7", "B"], "--data-path: weight -0.3 for A must be a finite number > 0"),
    (["--data-path", "0", "A", "1", "B"], "--data-path: weight 0 for A"),
    (["--data-path", "1", "A", "B", "0.5"], "--data-path: expected a weight at position 3, got 'B'"),
    (["--train-data-path", "0.5", "A", "0.5"], "--train-data-path .*must come in pairs"),
    (["--data-path", "MISSING"], "--data-path MISSING: no such file MISSING.idx"),
    (["--train-data-path", "A", "--valid-data-path", "MISSING"], "--valid-data-path MISSING: no such file"),
    (["--valid-data-path", "A"], "--valid-data-path / --test-data-path need --train-data-path"),
    (["--data-path", "A", "--train-data-path", "A"], "mutually exclusive"),
    (["--data-path", "A", "--num-workers", "-1"], "--num-workers must be >= 0"),
])
def test_bad_data_flags_name_the_flag(argv, message, corpora):
    """Would catch a malformed blend failing late (megatron-core reads '0.3 A 0.7' as three prefixes and
    fails on a missing '0.3.bin'; it asserts on a weight of 0), or a missing file found only after start-up."""
    argv = [corpora[0] if a == "A" else a for a in argv]
    message = message.replace("for A", "for " + corpora[0])
    with pytest.raises(ValueError, match=message):
        validate_args(build_parser().parse_args(argv), 1)


def test_blend_lists_parse_like_megatron():
    """Would catch a weighted list read as prefixes, or an unweighted one read as weights."""
    assert get_blend_from_list(["A"]) == (["A"], None)
    assert get_blend_from_list(["A", "B"]) == (["A", "B"], None)
    assert get_blend_from_list(["0.3", "A", "70", "B"]) == (["A", "B"], [0.3, 70.0])
    assert get_blend_from_list(None) is None
