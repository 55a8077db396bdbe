"""Last words: when a rank dies, every survivor writes its part of the last consistent training state.

With replicated distributed-optimizer state (num_distributed_optimizer_instances = R) every shard lives on
R ranks, so the survivors of a single failure together still hold all of it::

    dp=4, R=2      instance 0          instance 1        position j = rank % (dp/R)
                 rank 0   rank 1     rank 2   rank 3
    shards       [ S0 ]   [ S1 ]     [ S0 ]   [ S1 ]     rank 3 dies -> S1 survives on rank 1

    SAVE/last_words/iter_0000123/rank_00001.pt     this rank's shards (main params, moments, step) with
    SAVE/last_words/iter_0000123/rank_00001.json   the iteration, data position, schedule and RNG;
                                                   the .json (size, sha256) is written after the .pt

No collective is involved: each survivor writes on its own, when its training loop raises (a collective
with the dead rank fails, or its own error) or, from a watcher thread, when torchrun's SIGTERM arrives
(wherever the loop is, e.g. blocked in a collective that will never complete). The
state is the last one this rank completed: the optimizer's update is local (no collective inside) and runs
under `optimizer.update_lock`, and the training loop stages the record of the iteration about to complete
before the update, so the shard and its iteration always match. A set is complete when every position has
a file at the same iteration; `--load` then takes it if it is newer than the newest periodic checkpoint
(load.py); sealing a periodic checkpoint removes the sets it supersedes (files.prune_last_words). Model
parameters are rebuilt from the fp32 main shards: a half-finished parameter all-gather at the time of
failure does not matter. Frozen parameters never change in training and come from the model provider; a
model with persistent buffers (which training may change: BatchNorm's running statistics) is refused.
The directories are named in files.py.
"""

import json
import os
import re
import signal
import socket
import threading
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..distributed.layout import DataParallelTopology
from . import experts
from .files import ABSENT_ARGS, check_commit, digest, last_words_dir, last_words_entries, write_atomically
from .rng import get_rng_state, set_rng_state

_RANK_FILE = re.compile(r"^rank_(\d{5,})\.pt$")
_HEADER = ("iteration", "rank", "world", "per_instance", "position", "step")  # also in the .json
_RECORD_ONLY = ("steps_taken", "skipped_opt_param_scheduler")  # kept in memory, not written


def persistent_buffers(optimizer) -> List[str]:
    """The names of the persistent buffers (state_dict entries) of the optimizer's model chunks."""
    names = []
    for chunk in optimizer.model_chunks:
        buffers = {n for n, _ in chunk.module.named_buffers()}
        names += [k for k in chunk.untrained_state_dict() if k in buffers]
    return names


def _key(name: str, start: int) -> str:
    """A shard's key in the file's "chunks" (the on-disk name, kept so that older files load): name@start."""
    return f"{name}@{start}"


class LastWords:
    """Keeps the record of the last completed iteration and writes this rank's last words when the job dies.

    Args:
        root: the --save directory.
        optimizer, scheduler: what is trained (a MegatronOptimizer, whose main params the model is rebuilt
            from on load, and an OptimizerParamScheduler).
        iteration, consumed_train_samples: where training starts (0, or the resumed position).
        args: plain-data description of the run, stored for the architecture check on load.
    """

    def __init__(self, root: str, optimizer, scheduler, iteration: int, consumed_train_samples: int,
                 args: Optional[dict] = None):
        experts.refuse(optimizer, "last words", "train without them (--no-last-words)")
        if dist.get_world_size(optimizer.data_parallel_group) != dist.get_world_size():
            # Files are named by data-parallel rank: two groups' rank 0 would write the same file.
            raise ValueError(
                f"last words need the data-parallel group to be the whole job ({dist.get_world_size()} ranks), "
                f"this one has {dist.get_world_size(optimizer.data_parallel_group)}: train without them "
                f"(--no-last-words) and rely on periodic checkpoints (torch_dist handles several groups)"
            )
        buffers = persistent_buffers(optimizer)
        if buffers:  # every rank holds the same model: all raise alike
            raise ValueError(
                f"last words keep the optimizer's shards only, and rebuild the rest of the model from the model "
                f"provider; this model has persistent buffers ({', '.join(buffers[:5])}), which training may "
                f"change (BatchNorm's running statistics) and a restart from last words would silently reset: "
                f"train without them (--no-last-words) and rely on periodic checkpoints, which save buffers"
            )
        self.root, self.optimizer, self.scheduler = root, optimizer, scheduler
        self.args = args or {}
        self.rank = dist.get_rank(optimizer.data_parallel_group)
        self.world = dist.get_world_size(optimizer.data_parallel_group)
        self.topology = optimizer.data_parallel_topology
        self.per_instance = self.topology.intra_distributed_optimizer_instance_size
        self.committed = self._record(iteration, consumed_train_samples, scheduler.state_dict(),
                                      optimizer.steps_taken)
        self.start_iteration = iteration
        self.staged = None
        self.written: Optional[str] = None  # the file written, once done
        self._write_lock = threading.Lock()
        self._installed = False

    # ------------------------------------------------------------------ the record of progress
    def _record(self, iteration, consumed, scheduler_state, steps_taken, skipped_scheduler_state=None) -> dict:
        return {"iteration": iteration, "consumed_train_samples": consumed, "opt_param_scheduler": scheduler_state,
                "skipped_opt_param_scheduler": skipped_scheduler_state or scheduler_state,
                "rng_state": get_rng_state(), "steps_taken": steps_taken}

    def stage(self, iteration: int, consumed_train_samples: int):
        """Just before optimizer.step(): the record of the iteration about to complete (after backward, so
        the RNG is the one the next iteration starts from; the scheduler as it will be after its step)."""
        stepped = {**self.scheduler.state_dict(), "num_steps": self.scheduler.num_steps + 1}
        self.staged = self._record(iteration, consumed_train_samples, stepped, self.optimizer.steps_taken + 1,
                                   skipped_scheduler_state=self.scheduler.state_dict())

    def commit(self):
        """After the iteration completed: the staged record becomes the committed one."""
        with self.optimizer.update_lock:
            if self.staged is not None and self.staged["steps_taken"] == self.optimizer.steps_taken:
                self.committed, self.staged = self.staged, None

    def _current(self) -> Optional[dict]:
        """Under update_lock: the record matching the optimizer's state, None when the update was torn."""
        if self.optimizer.updating:
            return None
        record = self.committed
        if self.staged is not None and self.staged["steps_taken"] == self.optimizer.steps_taken:
            record = dict(self.staged)  # the update happened, the loop did not commit yet
            if not self.optimizer.last_step_successful:
                record["opt_param_scheduler"] = record["skipped_opt_param_scheduler"]
        return record

    # ------------------------------------------------------------------ writing
    @torch.no_grad()
    def write(self, reason: str) -> Optional[str]:
        """Write this rank's last words (once; later calls return the same path). Returns the file, or None
        when nothing consistent can be written (the update was torn, or the state is not finite)."""
        with self._write_lock:
            if self.written is not None:
                return self.written
            with self.optimizer.update_lock:  # the update (if running) finishes first; copies are taken now
                record = self._current()
                if record is None:
                    self._say(f"not writing last words ({reason}): the optimizer update was interrupted")
                    return None
                if record["iteration"] == self.start_iteration:  # e.g. a bad flag failing the first step
                    self._say(f"no last words ({reason}): no iteration completed since the start")
                    return None
                described = self.optimizer.sharded_state()
                shards = {_key(s.name, s.start): {k: t.float().cpu().clone() for k, t in s.tensors.items()}
                          for s in described.shards}
                payload = {"format": "last_words", "reason": reason, "rank": self.rank, "world": self.world,
                           "per_instance": self.per_instance, "position": self.topology.position(self.rank),
                           "optimizer": described.common, "step": described.step,
                           "lagging_steps": described.lagging_steps(), "chunks": shards, "args": self.args,
                           **{k: v for k, v in record.items() if k not in _RECORD_ONLY}}
            if not all(torch.isfinite(t).all() for entry in shards.values() for t in entry.values()):
                self._say(f"not writing last words ({reason}): the optimizer state is not finite")
                return None
            target = last_words_dir(self.root, record["iteration"])
            check_commit("last_words", f"writing last words at iteration {record['iteration']} to {target}")
            os.makedirs(target, exist_ok=True)
            path = os.path.join(target, f"rank_{self.rank:05d}.pt")
            write_atomically(path, lambda f: torch.save(payload, f))
            header = {k: payload[k] for k in _HEADER}
            sidecar = json.dumps({"size": os.path.getsize(path), "sha256": digest(path), **header})
            write_atomically(path[:-3] + ".json", lambda f: f.write(sidecar.encode()))
            self.written = path
            self._say(f"wrote last words at iteration {record['iteration']} to {path} ({reason})")
            return path

    def _say(self, text: str):
        print(f"[rank {self.rank}] > {text}", flush=True)

    # ------------------------------------------------------------------ SIGTERM
    def install(self):
        """On SIGTERM (torchrun tearing the job down), write the last words from a watcher thread and exit
        with 143. The training loop is never interrupted: wherever it is, even blocked in a collective that
        will not return, its state outside the update is consistent, and the update is waited for. Only in
        the main thread (where Python handles signals); elsewhere the loop's except path still writes."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._reader, self._waker = socket.socketpair()
        self._waker.setblocking(False)
        # Python's C-level handler writes the signal number to the wakeup fd at once, whatever the main
        # thread is doing; the Python-level handler (run later in the main thread, if ever) does nothing.
        self._previous_fd = signal.set_wakeup_fd(self._waker.fileno(), warn_on_full_buffer=False)
        self._previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        threading.Thread(target=self._watch, name="megatron_lite_last_words", daemon=True).start()
        self._installed = True

    def uninstall(self):
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous_handler)
            signal.set_wakeup_fd(self._previous_fd)
            self._waker.close()  # the watcher's recv returns b"" and it ends
            self._installed = False

    def _watch(self):
        while True:
            try:
                data = self._reader.recv(1)
            except OSError:
                break
            if not data:
                break
            if data[0] == signal.SIGTERM:
                try:
                    self.write("SIGTERM")
                finally:
                    os._exit(128 + signal.SIGTERM)
        self._reader.close()


# ---------------------------------------------------------------------- finding and loading
def scan(root: str) -> Tuple[Dict[int, Dict[int, List[str]]], Dict[int, str]]:
    """The last-words sets under `root`: ({iteration: {position: [files]}} of the complete ones,
    {iteration: what is wrong} of the others). A set is complete when every position 0 .. per_instance-1
    has a file whose .json (size, sha256) matches it, and all its files agree on the layout (the ranks per
    instance: a rank's shards are its position's, whatever the data-parallel size, see _misfit) and the
    optimizer step. Files of one iteration written at two data-parallel sizes (an elastic job that shrank
    while at it) complete each other."""
    sets, problems = {}, {}
    for iteration, directory in sorted(last_words_entries(root).items()):
        files, layouts, worlds, damaged = {}, set(), set(), []
        for fname in sorted(os.listdir(directory)):
            if _RANK_FILE.match(fname):
                path = os.path.join(directory, fname)
                header = _valid_header(path)
                if header is None:
                    damaged.append(fname)
                    continue
                layouts.add((header["per_instance"], header["step"], header["iteration"]))
                worlds.add(header["world"])
                files.setdefault(header["position"], []).append(path)
        note = f" ({', '.join(damaged)} damaged, ignored)" if damaged else ""
        if len(layouts) > 1:
            problems[iteration] = (f"last words at iteration {iteration} are inconsistent: (ranks per instance, "
                                   f"optimizer step, iteration) differ between files: {sorted(layouts)}{note}")
        elif not layouts:
            problems[iteration] = f"last words at iteration {iteration} hold no usable file{note}"
        else:
            (per_instance, _, _), world = layouts.pop(), max(worlds)
            missing = [p for p in range(per_instance) if p not in files]
            if missing:
                holders = [r for p in missing for r in _holders(world, per_instance, p)]
                problems[iteration] = (f"last words at iteration {iteration} are incomplete: shard position(s) "
                                       f"{missing} (held by rank(s) {holders}) survived on no rank{note}")
            else:
                sets[iteration] = files
    return sets, problems


def _valid_header(path: str) -> Optional[dict]:
    """The file's header (from its .json) if the .json's size and sha256 match the file, else None."""
    try:
        with open(path[:-3] + ".json") as f:
            header = json.load(f)
        if os.path.getsize(path) != header["size"] or digest(path) != header["sha256"]:
            return None
        return header
    except (OSError, ValueError, KeyError):
        return None


@torch.no_grad()
def load(files: Dict[int, List[str]], model, optimizer, scheduler, check_args: Optional[dict] = None,
         hyperparameters: str = "check", group=None, load_optim: bool = True, load_rng: bool = True) -> Optional[dict]:
    """Every rank: load the last words of this rank's position (its own file if it can be read, else a
    replica's) into the optimizer (and, through the main params, the model), the scheduler and the RNG.
    With `load_optim` False only the parameters (no moments, step, hyperparameters or schedule); with
    `load_rng` False not the RNG state (load_checkpoint's --no-load-optim / --no-load-rng).

    Every rank reads and checks its file before any collective, then all agree: a file that cannot be
    read is replaced by a replica's (said in the log); a position no rank can read makes every rank return
    None (the caller falls back to an older checkpoint; rank 0 names the files); a set that does not fit
    this run (data-parallel size, instances, architecture, layout) is a ValueError on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    topology = optimizer.data_parallel_topology
    per_instance = topology.intra_distributed_optimizer_instance_size
    where = os.path.dirname(next(p for paths in files.values() for p in paths))
    try:
        with open(next(p for paths in files.values() for p in paths)[:-3] + ".json") as f:
            header = json.load(f)  # scan checked it: the set's layout, the same in every file
        payload, path, unreadable, error = None, None, [], _misfit(header, where, world, per_instance)
        if error is None:
            payload, path, unreadable = _read_position(files, rank, topology.position(rank))
        if payload is not None:
            error = _misfit(payload, where, world, per_instance) or _unfit(payload, path, check_args, optimizer)
    except Exception as e:  # anything else a rank meets while reading: the others must hear of it
        payload, path, unreadable, error = None, None, [], f"{type(e).__name__}: {e}"
    everyone = collectives.all_gather_object({"error": error, "read": path, "unreadable": unreadable}, group)
    errors = {r: e["error"] for r, e in enumerate(everyone) if e["error"] is not None}
    if errors:
        raise ValueError("cannot resume from the last words in " + where + ": "
                         + "; ".join(f"rank {r}: {text}" for r, text in errors.items()))
    if rank == 0:
        used = {os.path.basename(p) for paths in files.values() for p in paths}
        for name in sorted(set(os.listdir(where)) - used):
            if _RANK_FILE.match(name):  # scan left it out: a replica holds its shards
                print(f"> last-words file {os.path.join(where, name)} is damaged (it does not match its .json): "
                      f"its shards are read from a replica", flush=True)
        for r, e in enumerate(everyone):
            for problem in e["unreadable"]:
                print(f"> {problem}" + (f"; rank {r} uses {e['read']}" if e["read"] else ""), flush=True)
    lost = [r for r, e in enumerate(everyone) if e["read"] is None]
    if lost:
        if rank == 0:
            print(f"> skipping the last words in {where}: no file of the shards of rank(s) {lost} can be read; "
                  f"falling back to an older checkpoint", flush=True)
        return None
    values = {(key.rsplit("@", 1)[0], int(key.rsplit("@", 1)[1])): entry for key, entry in payload["chunks"].items()}
    described = optimizer.sharded_state().with_values(values, payload["step"], payload.get("lagging_steps"))

    def small_state():  # local, and where it can fail (a hyperparameter differs), before any tensor is written
        if load_optim:
            optimizer.check_state_parts({name: entry.keys() for (name, _), entry in values.items()},
                                        payload.get("lagging_steps"))
            optimizer.load_common_state_dict(payload["optimizer"], hyperparameters)
            scheduler.load_state_dict(payload["opt_param_scheduler"], hyperparameters=hyperparameters)
        if load_rng:
            set_rng_state(payload["rng_state"])
    collectives.run_collectively(small_state, group=group)
    # The parameters only without load_optim, into the fresh optimizer (its step stays 0).
    optimizer.load_sharded_state(described if load_optim else described.params_only())
    model.finish_param_sync()
    return {"iteration": payload["iteration"], "consumed_train_samples": payload["consumed_train_samples"],
            "args": payload["args"], "path": path, "last_words": True}


def _holders(world: int, per_instance: int, position: int) -> Tuple[int, ...]:
    """The ranks that held `position` in a job described by a set's headers (none if they are not a
    valid layout: the set is reported incomplete either way)."""
    try:
        return DataParallelTopology.from_instance_size(world, per_instance).holders(position)
    except (ValueError, TypeError):
        return ()


_PAYLOAD_KEYS = {"world", "per_instance", "iteration", "consumed_train_samples", "args", "chunks", "optimizer", "step",
                 "opt_param_scheduler", "rng_state"}


def _read_position(files: Dict[int, List[str]], rank: int, position: int):
    """(payload, path, [what was wrong with each file tried before]) of this rank's position: its own file
    first, then the replicas'; (None, None, ...) when none can be read. Local: no collective."""
    own = f"rank_{rank:05d}.pt"
    unreadable = []
    for path in sorted(files.get(position, []), key=lambda p: os.path.basename(p) != own):
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(payload, dict) or not _PAYLOAD_KEYS <= set(payload):
                raise ValueError("not a last-words record")
            return payload, path, unreadable
        except Exception as e:  # a damaged file is one of the failures last words exist for
            unreadable.append(f"last-words file {path} passes its checksum but cannot be loaded "
                              f"({type(e).__name__}: {e})")
    return None, None, unreadable


def _misfit(record: dict, where: str, world: int, per_instance: int) -> Optional[str]:
    """Why last words written by another layout cannot be loaded (a header or a payload), or None. Only the
    ranks per instance matter: a rank's shards are its position's, and the buffers are cut for the instance's
    group (param_and_grad_buffer), so a set written at another data-parallel size with as many ranks per
    instance loads as it is (elastic mode: written by the instances left after a shrink)."""
    if record["per_instance"] != per_instance:
        return (f"the last words in {where} were written by {record['world']} ranks, {record['per_instance']} "
                f"per instance; this job has {world} ranks, {per_instance} per instance: resume with as many ranks "
                f"per instance (data-parallel size / --num-distributed-optimizer-instances), or move the "
                f"last_words directory away to resume from the periodic checkpoint")
    return None


def _unfit(payload: dict, path: str, check_args: Optional[dict], optimizer) -> Optional[str]:
    """Why a readable record cannot be loaded into this run's model (the same for every file of a set, so
    no replica helps: the user must change the run), or None."""
    for key, value in (check_args or {}).items():
        saved = payload["args"].get(key, ABSENT_ARGS.get(key))
        if saved is not None and saved != value:
            return f"last-words checkpoint {path} was trained with {key}={saved}, this run has {key}={value}"
    expected = {_key(s.name, s.start) for s in optimizer.sharded_state().shards}
    if set(payload["chunks"]) != expected:
        return f"{path} holds other shards than this rank's layout (bucket size or model differs)"
    return None
