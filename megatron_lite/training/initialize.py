"""Start-up: the process group and this rank's device, the seed, the tokenizer.

`initialize_distributed` is the one process-group helper of the project: pretrain_gpt.py, the examples,
the benchmarks' launcher and the tests' rank pool all join their group through it.
"""

import datetime
import os
import sys
import tempfile
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..data import build_tokenizer


def initialize_distributed(backend: Optional[str] = None, device: Optional[str] = None,
                           timeout_minutes: float = 10.0, rank: Optional[int] = None,
                           world_size: Optional[int] = None, init_method: Optional[str] = None) -> torch.device:
    """Join (or create) the default process group; returns this rank's device.

    Args:
        backend: 'gloo' or 'nccl' (default: nccl on CUDA, else gloo).
        device: 'cuda' or 'cpu' (default: cuda when available). On CUDA the rank takes GPU LOCAL_RANK
            (torchrun), else `rank` modulo the number of GPUs.
        timeout_minutes: a collective waiting longer than this fails instead of hanging.
        rank, world_size, init_method: an explicit rendezvous (e.g. file:// for spawned ranks). Without
            one: torchrun's env:// when RANK and WORLD_SIZE are set, else a world of one.
    An existing default group is kept as it is (only the device is chosen).
    """
    device_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank or 0)) % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        backend = backend or ("nccl" if device_type == "cuda" else "gloo")
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if init_method is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and \
                "TORCHELASTIC_RESTART_COUNT" in os.environ:  # torchrun hosts the store (its agent's)
            dist.init_process_group(backend, store=_torchrun_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        elif init_method is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)  # env:// (MASTER_ADDR, MASTER_PORT)
        else:
            if init_method is None:  # a plain `python script.py`: a world of one, file rendezvous (no port)
                init_file = tempfile.NamedTemporaryFile(prefix="mlite_init_", delete=False).name
                os.remove(init_file)
                init_method, rank, world_size = f"file://{init_file}", 0, 1
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timeout)
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def _torchrun_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, with the keys of this attempt (TORCHELASTIC_RESTART_COUNT) under a prefix of their
    own. With plain env:// on torch 2.13 a job restarted by `torchrun --max-restarts` finds the previous
    attempt's gloo addresses in the shared store and fails to connect ("Connection refused")."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"megatron_lite/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def shutdown(exit_code: int = 0):
    """Destroy the process group and end the process without the interpreter's finalization.

    After a clean run, gloo's worker threads abort the finalization now and then (SIGABRT, "terminate
    called without an active exception"; about 1 run in 8 on 2 CPU ranks with torch 2.13, cf.
    pytorch/pytorch#179291), which would turn a finished run into a failed one. Call this last, once
    everything is written and closed."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def vocab_size_with_padding(vocab_size: int, divisor: int = 128) -> int:
    """Megatron pads the embedding table to a multiple of 128 rows for fast matmuls (257 -> 384)."""
    return -(-vocab_size // divisor) * divisor


# --deterministic-mode: the environment bit-exact reruns need (Megatron's values). NCCL reads NCCL_ALGO when a
# communicator is created and cuBLAS CUBLAS_WORKSPACE_CONFIG when its handle is: both before the first collective
# or matmul, so this runs first thing at start-up. A value the launcher set is kept if it is one of these.
DETERMINISTIC_ENV = {"NCCL_ALGO": ("Ring",), "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8")}


def apply_deterministic_mode(env=os.environ):
    """Set the environment DETERMINISTIC_ENV names (keeping an accepted value already set) and make torch use
    deterministic kernels only (an op without one raises instead of running). Raises ValueError for a value
    that would break reproducibility."""
    for name, accepted in DETERMINISTIC_ENV.items():
        if env.get(name, accepted[0]) not in accepted:
            raise ValueError(f"--deterministic-mode: {name}={env[name]!r} is not reproducible; unset it or use "
                             f"one of {list(accepted)}")
    for name, accepted in DETERMINISTIC_ENV.items():
        env.setdefault(name, accepted[0])
    torch.use_deterministic_algorithms(True)


def initialize_megatron(args) -> Tuple[torch.device, object]:
    """pretrain()'s start-up: process group and device, the seed of the identical initial replicas, the
    tokenizer. Sets `args.padded_vocab_size` and `args.eod` (the values known only once the tokenizer is built).

    Returns:
        (device, tokenizer)
    """
    if args.deterministic_mode:
        apply_deterministic_mode()
    device = initialize_distributed(args.distributed_backend, args.device, args.distributed_timeout_minutes)
    if dist.get_world_size() != args.data_parallel_size:
        raise ValueError(f"arguments were validated for {args.data_parallel_size} ranks, the group has "
                         f"{dist.get_world_size()}")
    torch.manual_seed(args.seed)  # identical initial replicas on every rank
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, vocab_size=args.vocab_size,
                                vocab_file=args.vocab_file, merge_file=args.merge_file)
    args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size)
    args.eod = tokenizer.eod  # recorded in checkpoints: a resume must not change it
    return device, tokenizer
