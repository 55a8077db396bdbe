"""A forged torch_dist checkpoint never runs code when it is read (megatron_lite/checkpointing/dcp_metadata.py).

The forger controls every file of the checkpoint directory and rewrites manifest.json to match, so the
checksums do not stop anything. Each forgery carries a payload that would create a marker file; it must be
refused with a ValueError naming the file, both by --load (pretrain_gpt) and by tools/checkpoint_convert.py,
and the marker must never appear.
"""

import ast
import importlib.util
import io
import json
import os
import pickle
import shlex
import shutil
import struct
import sys

import pytest
import torch
from distributed_helper import run_distributed
from pretrain_testing import REPO, pretrain_outcome, tiny_pretrain_flags

TINY = tiny_pretrain_flags(num_layers="1", global_batch_size="4", log_interval="2", ckpt_format="torch_dist")
SAVE = ["--exit-interval", "4"]  # a checkpoint at iteration 4 of 6: resuming trains 5 and 6
ITER = "iter_0000004"
FS, MD = "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.metadata"


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A --save directory holding one genuine torch_dist checkpoint (no_shard, 1 rank) at iteration 4."""
    save = str(tmp_path_factory.mktemp("genuine") / "ck")
    assert run_distributed(pretrain_outcome, 1, TINY + SAVE + ["--save", save])[0][0] == "ok"
    return save


@pytest.fixture(scope="module")
def convert():
    """tools/checkpoint_convert.py's main, run in this process: (exit code, stderr) for an argv."""
    spec = importlib.util.spec_from_file_location("checkpoint_convert", os.path.join(REPO, "tools",
                                                                                     "checkpoint_convert.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def run(*argv):
        err, real = io.StringIO(), sys.stderr
        sys.stderr = err
        try:
            tool.main(list(argv))
            code = 0
        except SystemExit as e:
            code = e.code
        finally:
            sys.stderr = real
        return code, err.getvalue()
    return run


# ------------------------------------------------------------------------------------------ forging
def _reseal(directory):
    """Rewrite manifest.json for the files as they are now: what a forger does."""
    from megatron_lite.checkpointing import files

    path = os.path.join(directory, files.MANIFEST_FILENAME)
    manifest = json.load(open(path))
    manifest["files"] = {name: {"size": os.path.getsize(os.path.join(directory, name)),
                                "sha256": files.digest(os.path.join(directory, name))}
                         for name in sorted(os.listdir(directory)) if name != files.MANIFEST_FILENAME}
    json.dump(manifest, open(path, "w"))


def _u(text: str) -> bytes:
    """A BINUNICODE opcode pushing `text`."""
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _stack_global(module: str, name: str) -> bytes:  # protocol 4: the name may be dotted
    return _u(module) + _u(name) + b"\x93"


CALL1 = b"\x85R"  # TUPLE1 REDUCE: top(arg) called on the object below


class _Exploit:
    """Pickles to a call of `func(*args)`: what runs when it is unpickled."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _genuine_metadata(directory):
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own checkpoint: trusted


def _raw(payload):
    return lambda directory, marker: payload(marker)


def _nested(protocol, func=os.system):
    """The genuine metadata with a __reduce__ object inside (in planner_data), pickled at `protocol`."""
    def write(directory, marker):
        metadata = _genuine_metadata(directory)
        args = (f"touch {shlex.quote(marker)}",) if func is os.system else (f"open({marker!r}, 'w').close()",)
        metadata.planner_data = {**metadata.planner_data, "extra": _Exploit(func, *args)}
        return pickle.dumps(metadata, protocol=protocol)
    return write


def _bytes_entry(directory, marker):
    """The genuine metadata with one model entry declared as bytes, stored in a new file that holds a
    torch.save'd payload: DCP would torch.load(weights_only=False) it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = _genuine_metadata(directory)
    key = "model.final_layernorm.weight"
    buffer = io.BytesIO()
    torch.save(_Exploit(os.system, f"touch {shlex.quote(marker)}"), buffer)
    with open(os.path.join(directory, "__0_1.distcp"), "wb") as f:
        f.write(buffer.getvalue())
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__0_1.distcp", 0, len(buffer.getvalue()))
    return pickle.dumps(metadata)


FORGERIES = {
    # GLOBAL (protocol 0 form) of a forbidden function
    "GLOBAL os.system": _raw(lambda m: b"cos\nsystem\n" + _u(f"touch {shlex.quote(m)}") + CALL1 + b"."),
    "GLOBAL builtins.exec": _raw(lambda m: b"cbuiltins\nexec\n" + _u(f"open({m!r}, 'w').close()") + CALL1 + b"."),
    # protocol 4 STACK_GLOBAL: a dotted name under an allowed module reaches any attribute of it
    "STACK_GLOBAL filesystem.os.system": _raw(lambda m: b"\x80\x04" + _stack_global(FS, "os.system")
                                              + _u(f"touch {shlex.quote(m)}") + CALL1 + b"."),
    "STACK_GLOBAL filesystem.Path.touch": _raw(lambda m: b"\x80\x04" + _stack_global(FS, "Path.touch")
                                               + _stack_global("pathlib", "PosixPath") + _u(m) + CALL1 + CALL1 + b"."),
    # REDUCE of an allowed record: its __init__ with the forger's arguments
    "REDUCE Metadata": _raw(lambda m: b"\x80\x04" + _stack_global(MD, "Metadata") + b"}" + CALL1 + b"."),
    # BUILD on an allowed class (not an instance): would set attributes of DCP's class for the whole process
    "BUILD on a class": _raw(lambda m: b"\x80\x04" + _stack_global(MD, "TensorStorageMetadata")
                             + b"N}" + _u("pwned") + b"\x88s\x86b."),
    "__reduce__ builtins.open, the whole file": _raw(lambda m: pickle.dumps(_Exploit(open, m, "w"))),
    **{f"__reduce__ protocol {p}": _nested(p) for p in range(6)},
    "__reduce__ builtins.exec": _nested(4, func=exec),
    "bytes entry": _bytes_entry,
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_checkpoint_runs_no_code(forgery, genuine, convert, tmp_path):
    """Would catch any way a forged .metadata (or a bytes entry it declares) gets unpickled with code in it:
    prefix-matched modules, dotted names, REDUCE/BUILD of allowed classes, nested __reduce__ objects at any
    protocol, DCP's torch.load(weights_only=False) of bytes entries; in --load and in checkpoint_convert."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    save = str(tmp_path / "ck")
    shutil.copytree(genuine, save)
    directory, marker = os.path.join(save, ITER), str(tmp_path / "PWNED")
    data = FORGERIES[forgery](directory, marker)
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(data)
    _reseal(directory)
    path = os.path.join(directory, ".metadata")
    expected = ["'model.final_layernorm.weight' is a BytesStorageMetadata"] if forgery == "bytes entry" \
        else ["cannot be read safely"]
    try:
        status, message = run_distributed(pretrain_outcome, 1, TINY + ["--save", save, "--load", save])[0]
        assert status == "error" and path in message and all(e in message for e in expected), message
        code, err = convert("--input", save, "--export-weights", str(tmp_path / "weights.pt"))
        assert code == 2 and path in err and all(e in err for e in expected), err
        assert not os.path.exists(marker)
    finally:
        assert not hasattr(TensorStorageMetadata, "pwned")


def test_genuine_torch_dist_checkpoints_still_load(genuine, convert, tmp_path):
    """Would catch the safe reader refusing what DCP really writes: a no_shard checkpoint resumed under
    ZeRO-3 on 2 ranks, a ZeRO-3 one (ShardedTensor pieces) resumed with no_shard on 1, both converted."""
    sharded = str(tmp_path / "z3")
    zero3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce"]
    assert run_distributed(pretrain_outcome, 2, TINY + SAVE + zero3 + ["--save", sharded])[0][0] == "ok"
    for save, world, flags in [(genuine, 2, zero3), (sharded, 1, [])]:
        resumed = run_distributed(pretrain_outcome, world, TINY + flags + ["--load", save])
        assert all(status == "ok" and sorted(losses) == [5, 6] for status, losses in resumed), (save, resumed)
        code, err = convert("--input", save, "--export-weights", str(tmp_path / "weights.pt"))
        assert code == 0, err
        assert torch.load(tmp_path / "weights.pt", weights_only=True).keys()


def test_genuine_metadata_reads_back_exactly_at_every_protocol(genuine, tmp_path):
    """Would catch the opcode interpreter building other values than pickle does (a wrong memo, a dropped
    field), or one that breaks on protocol 5 (Python 3.14's default) or protocol 2/3 (older writers)."""
    from megatron_lite.checkpointing.dcp_metadata import read_metadata

    reference = _genuine_metadata(os.path.join(genuine, ITER))
    for protocol in range(2, 6):
        path = str(tmp_path / f"metadata{protocol}")
        with open(path, "wb") as f:
            pickle.dump(reference, f, protocol=protocol)
        metadata = read_metadata(path)
        for field in ("state_dict_metadata", "storage_data", "planner_data", "version"):
            assert getattr(metadata, field) == getattr(reference, field), (protocol, field)
        assert metadata.storage_meta.checkpoint_id == str(reference.storage_meta.checkpoint_id)


def _storage_forgeries():
    """name -> a function of the genuine metadata returning what the forger pickles instead."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def storage(**change):
        def forge(metadata):
            index = next(iter(metadata.storage_data))
            info = metadata.storage_data[index]
            fields = {"relative_path": info.relative_path, "offset": info.offset, "length": info.length, **change}
            metadata.storage_data[index] = _StorageInfo(**fields)
            return metadata
        return forge

    def entry(field, value):
        def forge(metadata):
            setattr(next(iter(metadata.state_dict_metadata.values())), field, value)
            return metadata
        return forge

    def extra_field(metadata):  # pickled into the record's BUILD state: a field _StorageInfo does not have
        vars(next(iter(metadata.storage_data.values())))["checksum_file"] = "__0_0.distcp"
        return metadata
    return {
        "file outside the directory": storage(relative_path="../../elsewhere.distcp"),
        "file name only containing a shard's": storage(relative_path="../__0_0.distcp"),
        "shard name with a suffix": storage(relative_path="__0_0.distcp.bak"),
        "storage record with an extra field": extra_field,
        "stream transform": storage(transform_descriptors=["zstd"]),
        "negative offset": storage(offset=-1),
        "planner data not keys": lambda m: (m.planner_data.update({"x": 3}), m)[1],
        "size not a torch.Size": entry("size", [4]),
        "chunk not a chunk": entry("chunks", [torch.Size([0])]),
        "not a Metadata": lambda m: m.storage_data,
    }


@pytest.mark.parametrize("name", list(_storage_forgeries()))
def test_metadata_of_other_types_is_refused(name, genuine, tmp_path):
    """Would catch storage items or entries of types DCP would act on in unchecked ways (a file outside the
    checkpoint, a stream transform, a tensor description that is not one) reaching DCP; a file name matched
    by search instead of in full ('../__0_0.distcp' only contains a shard's name), and a record filled with a
    field it does not have (BUILD checking only that the keys are strings)."""
    from megatron_lite.checkpointing.dcp_metadata import read_metadata

    payload = _storage_forgeries()[name](_genuine_metadata(os.path.join(genuine, ITER)))
    path = str(tmp_path / ".metadata")
    with open(path, "wb") as f:
        pickle.dump(payload, f)
    with pytest.raises(ValueError, match="checkpoint metadata") as info:
        read_metadata(path)
    assert path in str(info.value)


def test_safe_reader_refuses_byte_reads_whatever_the_metadata(genuine):
    """The second line of defence: even with metadata that skipped read_metadata, DCP's reader must not be
    set up with a bytes entry nor asked to read bytes (it would torch.load(weights_only=False) them)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from megatron_lite.checkpointing.torch_dist import SafeReader

    directory = os.path.join(genuine, ITER)
    metadata = _genuine_metadata(directory)
    metadata.state_dict_metadata["extra"] = BytesStorageMetadata()
    with pytest.raises(ValueError, match="'extra' is a BytesStorageMetadata"):
        SafeReader(directory).set_up_storage_reader(metadata, True)
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("extra"), dest_offsets=torch.Size([0]),
                    storage_index=MetadataIndex("extra"), storage_offsets=torch.Size([0]), lengths=torch.Size([0]))
    with pytest.raises(ValueError, match="'extra' is not stored as a tensor"):
        SafeReader(directory).read_data(LoadPlan([item]), planner=None)


SOURCES = ["megatron_lite", "tools", "pretrain_gpt.py", "examples", "benchmarks"]


def _unsafe_reads(source: str, path: str):
    """(line, what) of every read in `source` that could unpickle code: pickle/dill/cloudpickle loads and
    Unpicklers, torch.load without weights_only=True, numpy loads with allow_pickle=True."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib") \
                and node.attr in ("load", "loads", "Unpickler", "_Unpickler"):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "_pickle", "dill", "cloudpickle") \
                and any(a.name in ("load", "loads", "Unpickler") for a in node.names):
            found.append((node.lineno, f"from {node.module} import"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            keywords = {k.arg: k.value for k in node.keywords}
            owner = ast.unparse(node.func.value)
            if owner in ("torch", "torch.serialization") and not (
                    isinstance(keywords.get("weights_only"), ast.Constant) and keywords["weights_only"].value is True):
                found.append((node.lineno, "torch.load without weights_only=True"))
            if owner in ("np", "numpy") and not (isinstance(keywords.get("allow_pickle"), ast.Constant)
                                                 and keywords["allow_pickle"].value is False):
                found.append((node.lineno, "numpy.load without allow_pickle=False"))
    return found


def test_no_source_file_reads_a_pickle_that_may_run_code():
    """Would catch a new torch.load(weights_only=False), a pickle.load or an np.load(allow_pickle=True) of a
    file anywhere in the project (checkpoints, data, tools, benchmarks): every read must be code-free."""
    assert _unsafe_reads("torch.load(p)\npickle.loads(b)\ntorch.load(p, weights_only=True)\n", "x") == [
        (1, "torch.load without weights_only=True"), (2, "pickle.loads")]  # the scanner itself sees them
    problems = []
    for source in SOURCES:
        root = os.path.join(REPO, source)
        paths = [root] if root.endswith(".py") else [os.path.join(d, n) for d, _, names in os.walk(root)
                                                     for n in names if n.endswith(".py")]
        for path in paths:
            problems += [(os.path.relpath(path, REPO), *hit) for hit in _unsafe_reads(open(path).read(), path)]
    assert problems == []
