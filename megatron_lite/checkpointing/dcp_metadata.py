"""Reading a torch_dist checkpoint's `.metadata` (DCP's index, a pickle) without ever running code.

Threat model: a checkpoint directory may have been written by someone else (downloaded, shared, copied from
a machine one does not control), and its manifest only proves that the files are those it lists, not who
wrote them. Reading a checkpoint must therefore never execute code: a forged checkpoint may at worst fail to
load with a ValueError naming the file, or load wrong numbers.

The contract, piece by piece:

* `read_metadata` never hands `.metadata` to pickle. It interprets the opcodes itself (pickletools.genops
  parses them, nothing else runs) and builds objects only in these ways:

  - a global is one of the exact (module, name) pairs below, nothing else: no module prefixes and no dotted
    names (protocol 4 lets STACK_GLOBAL name "os.system" under an allowed module: that is just an unknown pair);
  - DCP's metadata records (dataclasses) are created by NEWOBJ with no arguments, i.e. object.__new__ (no
    __init__ runs), and filled by BUILD with a dict of their own field names only (TensorProperties: the
    5-tuple its own __setstate__ unpacks). BUILD on anything else (a class, a dtype) is refused;
  - REDUCE calls only this module's constructors, each checking its arguments: torch.Size from integers, the
    memory-format enum from an integer, a layout looked up by name (torch.serialization._get_layout's pickled
    name, never called), and a path's parts joined into a plain str (pathlib.PosixPath, never built);
  - dtypes are values (torch.float32, ...), not callables; lists, dicts and tuples are built only by their own
    opcodes and APPEND/SETITEM act only on real lists and dicts (pickle would call the target's `append`).

* `check_metadata` then checks the types of the whole tree. Every entry must be a TensorStorageMetadata:
  megatron-lite never writes a BytesStorageMetadata entry, and DCP reads one with torch.load(weights_only=
  False), i.e. would run its pickle (megatron_read.py reads megatron-core's, `allow_bytes`, with a planner of
  its own that never does). Every storage item must be a _StorageInfo naming a `__R_F.distcp` file of
  the checkpoint directory, at non-negative offsets, with no stream transforms.

* `SafeReader` is DCP's FileSystemReader with the metadata read as above, checked again where DCP sets the
  reader up, and any byte (non-tensor) read refused in read_data: that is the one path where DCP's reader
  unpickles freely (planner.load_bytes); its tensor reads are torch.load(weights_only=True).
"""

import dataclasses
import os
import pickletools
import re
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, SavePlan, TensorWriteData, WriteItem, WriteItemType

METADATA_FILENAME = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"

# The records a .metadata holds. BytesStorageMetadata (an empty record) is accepted here only so that
# check_metadata can refuse it naming the entry.
_RECORDS = {(_DCP, cls.__name__): cls for cls in (Metadata, TensorStorageMetadata, BytesStorageMetadata,
                                                  ChunkStorageMetadata, TensorProperties, StorageMeta, MetadataIndex)}
_RECORDS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
# megatron-core (a Megatron-LM checkpoint, megatron_read.py) adds its save plans as Metadata.all_local_plans.
_RECORDS.update({("torch.distributed.checkpoint.planner", cls.__name__): cls
                 for cls in (SavePlan, WriteItem, TensorWriteData)})
_RECORD_TYPES = {cls: {f.name for f in dataclasses.fields(cls)} for cls in _RECORDS.values()}
_RECORD_TYPES[Metadata] = _RECORD_TYPES[Metadata] | {"all_local_plans"}


def _size(dims=()) -> torch.Size:
    if type(dims) not in (tuple, list) or not all(type(d) is int for d in dims):
        raise ValueError(f"a torch.Size of {dims!r}")
    return torch.Size(dims)


def _memory_format(value) -> _MEM_FORMAT_ENCODING:
    if type(value) is not int:
        raise ValueError(f"a memory format of {value!r}")
    return _MEM_FORMAT_ENCODING(value)


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name) -> torch.layout:
    if type(name) is not str or name not in _LAYOUTS:
        raise ValueError(f"a layout named {name!r}")
    return _LAYOUTS[name]


def _write_item_type(value) -> WriteItemType:
    if type(value) is not int:
        raise ValueError(f"a write item type of {value!r}")
    return WriteItemType(value)


def _path(*parts) -> str:
    """StorageMeta.checkpoint_id (where the checkpoint was saved; DCP does not use it to load): kept as text."""
    if not all(type(p) is str for p in parts):
        raise ValueError(f"a path of {parts!r}")
    return os.path.join(*parts) if parts else ""


# What REDUCE may call, by the pickled (module, name): only the functions above (Python 3.13 pickles paths
# as pathlib._local.PosixPath).
_CONSTRUCTORS: Dict[Tuple[str, str], Callable] = {
    ("torch", "Size"): _size, (_DCP, "_MEM_FORMAT_ENCODING"): _memory_format,
    ("torch.serialization", "_get_layout"): _layout,
    **{(module, name): _path for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")},
    ("torch.distributed.checkpoint.planner", "WriteItemType"): _write_item_type,
}
_CALLABLE = set(_CONSTRUCTORS.values())
_DTYPES = {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}

_ARGUMENT_OPS = {"BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE"}
_CONSTANT_OPS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_PUT_OPS, _GET_OPS = {"BINPUT", "LONG_BINPUT"}, {"BINGET", "LONG_BINGET"}
_TUPLE_OPS = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_EMPTY_OPS = {"EMPTY_LIST": list, "EMPTY_DICT": dict, "EMPTY_TUPLE": tuple}


def _resolve(module, name):
    pair = (module, name)
    for table in (_RECORDS, _CONSTRUCTORS, _DTYPES):
        if pair in table:
            return table[pair]
    raise ValueError(f"it names {module}.{name}, which a DCP metadata file of megatron-lite never holds")


def _build(obj, state):
    """BUILD: fill a freshly created record, as pickle would, but only with its own fields."""
    fields = _RECORD_TYPES.get(type(obj))
    if fields is None:
        raise ValueError(f"BUILD of a {type(obj).__name__}, which is not a DCP metadata record")
    if type(obj) is TensorProperties:  # DCP's __setstate__ unpacks (dtype, layout, grad, format, pin)
        if type(state) is not tuple or len(state) != 5:
            raise ValueError("TensorProperties state that is not a 5-tuple")
        obj.__setstate__(state)
    elif type(state) is dict and all(type(k) is str and k in fields for k in state):
        vars(obj).update(state)
    else:
        raise ValueError(f"a {type(obj).__name__} state with other keys than its fields {sorted(fields)}")


def _interpret(file) -> Any:
    """The object a protocol 2-5 pickle of DCP metadata describes (see the module docstring). The opcodes
    are tested roughly in the order of their frequency in DCP's metadata."""
    stack, marks, memo = [], [], {}
    for op, arg, pos in pickletools.genops(file):
        name = op.name
        if name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in _GET_OPS:
            stack.append(memo[arg])
        elif name in _TUPLE_OPS:
            n = _TUPLE_OPS[name]
            if len(stack) < n:
                raise ValueError(f"{name} on a short stack")
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif name == "REDUCE":
            args, func = stack.pop(), stack.pop()
            if not (callable(func) and func in _CALLABLE) or type(args) is not tuple:
                raise ValueError(f"REDUCE of {func!r}: nothing but torch.Size, layouts, paths and the memory-format "
                                 f"enum is ever called")
            stack.append(func(*args))
        elif name in _ARGUMENT_OPS:
            stack.append(arg)
        elif name == "MARK":
            marks.append(stack)
            stack = []
        elif name in _EMPTY_OPS:
            stack.append(_EMPTY_OPS[name]())
        elif name == "NEWOBJ":
            args, cls = stack.pop(), stack.pop()
            if cls not in _RECORD_TYPES or args != ():  # a class (hashable); object.__new__ runs no code of it
                raise ValueError(f"NEWOBJ of {cls!r}{args!r}: only DCP's records, without arguments")
            stack.append(object.__new__(cls))
        elif name == "BUILD":
            state = stack.pop()
            _build(stack[-1], state)
        elif name in ("SETITEMS", "APPENDS", "TUPLE", "LIST", "DICT"):
            items, stack = stack, marks.pop()
            if name == "TUPLE":
                stack.append(tuple(items))
            elif name == "LIST":
                stack.append(items)
            elif name == "APPENDS":
                _container(stack[-1], list).extend(items)
            else:
                if len(items) % 2:
                    raise ValueError(f"{name} with an odd number of items")
                target = {} if name == "DICT" else _container(stack[-1], dict)
                target.update(zip(items[::2], items[1::2]))
                if name == "DICT":
                    stack.append(target)
        elif name in _CONSTANT_OPS:
            stack.append(_CONSTANT_OPS[name])
        elif name == "APPEND":
            value = stack.pop()
            _container(stack[-1], list).append(value)
        elif name == "SETITEM":
            value, key = stack.pop(), stack.pop()
            _container(stack[-1], dict)[key] = value
        elif name in _PUT_OPS:
            memo[arg] = stack[-1]
        elif name == "STACK_GLOBAL":
            attribute, module = stack.pop(), stack.pop()
            if type(module) is not str or type(attribute) is not str:
                raise ValueError("STACK_GLOBAL of non-strings")
            stack.append(_resolve(module, attribute))
        elif name == "GLOBAL":
            stack.append(_resolve(*arg.split(" ", 1)))
        elif name == "POP":
            stack.pop()
        elif name == "FRAME":
            pass  # genops reads through frames
        elif name == "PROTO":
            if not 2 <= arg <= 5:
                raise ValueError(f"pickle protocol {arg} (DCP writes protocol 2 to 5)")
        elif name == "STOP":
            if len(stack) != 1 or marks:
                raise ValueError("STOP with an unbalanced stack")
            return stack[0]
        else:
            raise ValueError(f"opcode {name} at byte {pos}, which a DCP metadata file never holds")
    raise ValueError("no STOP opcode")


def _container(obj, kind):
    if type(obj) is not kind:  # pickle would call e.g. obj.append: a method of an arbitrary object
        raise ValueError(f"adding items to a {type(obj).__name__}")
    return obj


def read_metadata(path: str, allow_bytes: bool = False) -> Metadata:
    """The DCP Metadata in the file `path`, built without running code and checked (check_metadata; with
    `allow_bytes`, byte entries pass, for a reader that never unpickles them as DCP does).
    Raises ValueError naming `path` if it holds anything else."""
    try:
        with open(path, "rb") as f:
            metadata = _interpret(f)
    except Exception as e:  # whatever goes wrong, the file cannot be read: one clear error
        raise ValueError(f"checkpoint metadata {path} cannot be read safely: {e}") from e
    return check_metadata(metadata, path, allow_bytes)


# ------------------------------------------------------------------------------------------ checks
def _field(obj, name, where, *types):
    value = getattr(obj, name, _field)
    if type(value) not in types:
        raise ValueError(f"checkpoint metadata {where}: {type(obj).__name__}.{name} is a {type(value).__name__}, "
                         f"not a {' or '.join(t.__name__ for t in types)}")
    return value


def _check_shape(size, where, what):
    if type(size) is not torch.Size or any(d < 0 for d in size):
        raise ValueError(f"checkpoint metadata {where}: {what} is {size!r}, not a torch.Size")


def _check_tensor(entry: TensorStorageMetadata, where: str, key: str):
    at = f"{where} (entry {key!r})"
    properties = _field(entry, "properties", at, TensorProperties)
    _field(properties, "dtype", at, torch.dtype)
    if _field(properties, "layout", at, torch.layout) is not torch.strided:
        raise ValueError(f"checkpoint metadata {at}: a {properties.layout} tensor, megatron-lite writes strided ones")
    _field(properties, "requires_grad", at, bool)
    _field(properties, "pin_memory", at, bool)
    _field(properties, "memory_format", at, torch.memory_format)
    size = _field(entry, "size", at, torch.Size)
    _check_shape(size, at, "its size")
    for chunk in _field(entry, "chunks", at, list):
        if type(chunk) is not ChunkStorageMetadata:
            raise ValueError(f"checkpoint metadata {at}: a chunk is a {type(chunk).__name__}")
        for attr in ("offsets", "sizes"):
            _check_shape(getattr(chunk, attr, None), at, f"a chunk's {attr}")
            if len(getattr(chunk, attr)) != len(size):
                raise ValueError(f"checkpoint metadata {at}: a chunk's {attr} do not match the size {list(size)}")
        if any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, size)):
            raise ValueError(f"checkpoint metadata {at}: a chunk reaches beyond the size {list(size)}")


_DISTCP_FILE = re.compile(r"__\d+_\d+\.distcp")


def _check_storage(index, info, where: str):
    if type(index) is not MetadataIndex or type(getattr(index, "fqn", None)) is not str:
        raise ValueError(f"checkpoint metadata {where}: a storage key is a {type(index).__name__}")
    at = f"{where} (storage of {index.fqn!r})"
    if _field(index, "offset", at, torch.Size, type(None)) is not None:
        _check_shape(index.offset, at, "its offset")
    _field(index, "index", at, int, type(None))
    if type(info) is not _StorageInfo:
        raise ValueError(f"checkpoint metadata {at}: a {type(info).__name__}, not a _StorageInfo")
    path = _field(info, "relative_path", at, str)
    if not _DISTCP_FILE.fullmatch(path):
        raise ValueError(f"checkpoint metadata {at}: the file {path!r} is not a __R_F.distcp file of the directory")
    if _field(info, "offset", at, int) < 0 or _field(info, "length", at, int) < 0:
        raise ValueError(f"checkpoint metadata {at}: a negative offset or length")
    if _field(info, "transform_descriptors", at, type(None), list, tuple):
        raise ValueError(f"checkpoint metadata {at}: stream transforms {info.transform_descriptors!r}, which "
                         f"megatron-lite never writes")


def check_metadata(metadata, where: str, allow_bytes: bool = False) -> Metadata:
    """`metadata` if it is a DCP Metadata of tensors (and with `allow_bytes` byte entries) only (see the module
    docstring), else ValueError naming `where` (the file) and the offending entry."""
    if type(metadata) is not Metadata:
        raise ValueError(f"checkpoint metadata {where} holds a {type(metadata).__name__}, not a DCP Metadata")
    entries = _field(metadata, "state_dict_metadata", where, dict)
    for key, entry in entries.items():
        if type(key) is not str:
            raise ValueError(f"checkpoint metadata {where}: an entry's key is a {type(key).__name__}")
        if allow_bytes and type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            raise ValueError(f"checkpoint metadata {where}: entry {key!r} is a {type(entry).__name__}, not a tensor "
                             f"(TensorStorageMetadata). megatron-lite writes tensors only, and DCP would read this "
                             f"entry with torch.load(weights_only=False), i.e. run whatever it holds: refusing")
        _check_tensor(entry, where, key)
    for index, info in _field(metadata, "storage_data", where, dict).items():
        _check_storage(index, info, where)
    planner = _field(metadata, "planner_data", where, dict, type(None)) or {}
    for key, path in planner.items():  # the flattening map: key -> the path of keys it came from
        if type(key) is not str or type(path) not in (tuple, list) or any(type(p) not in (str, int) for p in path):
            raise ValueError(f"checkpoint metadata {where}: planner data {key!r} is not a path of keys")
    storage_meta = _field(metadata, "storage_meta", where, StorageMeta, type(None))
    if storage_meta is not None:
        for name in ("checkpoint_id", "save_id", "load_id"):
            _field(storage_meta, name, where, str, type(None))
        if any(type(m) is not str for m in _field(storage_meta, "modules", where, list)):
            raise ValueError(f"checkpoint metadata {where}: StorageMeta.modules holds a non-string")
    _field(metadata, "version", where, str, type(None))
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader that never runs code from the checkpoint (see the module docstring)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata files, which are never written
            raise ValueError(f"checkpoint {self.path} has no per-rank metadata: megatron-lite writes only "
                             f"{METADATA_FILENAME}")
        metadata = read_metadata(os.path.join(self.path, METADATA_FILENAME))
        if metadata.storage_meta is None:  # as DCP's own reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        check_metadata(metadata, os.path.join(self.path, METADATA_FILENAME))  # what DCP uses is what was checked
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan, planner):
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:  # DCP would torch.load(weights_only=False) these bytes
                raise ValueError(f"checkpoint {self.path}: {item.storage_index.fqn!r} is not stored as a tensor")
        return super().read_data(plan, planner)
