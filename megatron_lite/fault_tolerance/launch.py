"""The live-recovery supervisor: starts the ranks, and when one dies restarts that rank only.

    python -m megatron_lite.fault_tolerance.launch --nproc-per-node 4 [--max-replacements 20]
        [--collective-timeout 3] [--join-timeout 60] [--max-restarts 1]
        [--min-instances 1 [--replacement-timeout 10]] pretrain_gpt.py ARGS...

torchrun's agent cannot do this: on a worker's failure it stops every local worker and restarts them all
(torch.distributed.elastic's LocalElasticAgent; `--max-restarts` counts those whole-group restarts), which
is the restart-everything path (docs/fault_tolerance.md). This supervisor keeps torchrun's conventions (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the workers' environment; a c10d TCPStore it hosts) and adds
the generation keys of membership.py:

    a worker exits 0            done (the job ends when every rank is done)
    a worker dies (a signal)    generation += 1, gen_<g>/replaced = [rank]; a process for that rank only: a
                                warm spare (--spares, started ahead with torch imported) or a new one
    a rank reports trouble      (a collective failed, no process died within --trouble-grace seconds):
                                generation += 1 with no replacement, every rank re-forms the groups
    elastic (--min-instances)   a replacement not back (its process not ready to join) --replacement-timeout
                                seconds after the death: generation += 1 with the complete instances only
                                (shrink; its instance partners wait, alive, to be admitted); once every rank
                                of a left-out instance is ready: gen_<g>/leave_at = an iteration all members
                                have yet to pass, generation += 1 with them all (grow)
    a left-out rank dies        (elastic) only a new process for it, waiting to be admitted like the others
    training finished           ranks not training exit by themselves ('finished'); any left after 30 s are
                                stopped
    a worker exits 3            live recovery is impossible (both holders of a shard lost), or a worker
    (EXIT_FALLBACK) or 1        raised an error of its own (a bug, a NaN: a new process would meet it again):
                                every worker is stopped (SIGTERM: last words) and the whole job restarted,
                                which resumes with --load, up to --max-restarts times (torchrun's behaviour)
    a worker exits 2            a usage error (argparse: the command line is wrong): every process started
    (EXIT_USAGE)                with it would fail alike, so the supervisor stops the others and exits 2
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from ..distributed.layout import DataParallelTopology
from . import membership
from .membership import EXIT_FALLBACK, LiveConfig

EXIT_USAGE = 2
"""argparse's exit code for a bad command line (also Python's for a script it cannot open): not replaced."""

FINISH_GRACE_S = 30.0
"""Seconds the supervisor waits, after training finished, for the ranks that were not training to exit."""


class Supervisor:
    """The workers of one job and the store of their generations (see the module docstring)."""

    def __init__(self, command, world_size: int, config: LiveConfig, max_replacements: int, max_restarts: int,
                 trouble_grace_s: float, spares: int = 1, replacement_timeout_s: float = 10.0):
        self.command, self.world_size, self.config = command, world_size, config
        self.max_replacements, self.max_restarts, self.trouble_grace_s = max_replacements, max_restarts, trouble_grace_s
        self.replacement_timeout_s = replacement_timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.generation = -1  # the first is 0
        self.members = list(range(world_size))  # the ranks training in the current generation
        self.workers = {}  # rank -> Popen
        self.pending = {}  # rank -> pid: replacement processes not yet ready to join (no standby/<rank>)
        self.pending_since = {}  # rank -> when it first needed a replacement (kept across failed replacements)
        self.done = set()
        self.num_spares = spares
        self.spares = []  # [(id, Popen)] warm processes waiting for a rank, oldest first
        self.spare_count = 0
        self.spare_after_logged = None  # replenish the spares once training passed this iteration again

    def say(self, text: str):
        print(f"[supervisor] {text}", flush=True)

    def _env(self, **extra) -> dict:
        elastic = {} if self.config.min_instances is None else {
            membership.ENV_MIN_INSTANCES: str(self.config.min_instances)}
        return {**os.environ, "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                membership.ENV_STORE: f"127.0.0.1:{self.store.port}",
                membership.ENV_COLLECTIVE_TIMEOUT: str(self.config.collective_timeout_s),
                membership.ENV_JOIN_TIMEOUT: str(self.config.join_timeout_s), **elastic, **extra}

    def spawn(self, rank: int):
        """A process for `rank` in the current generation: a warm spare if one is waiting, else a new one."""
        if self.spares:
            spare, proc = self.spares.pop(0)
            self.store.set(f"spare_{spare}/assign", json.dumps({"rank": rank, "generation": self.generation}))
            self.workers[rank] = proc
            self.say(f"rank {rank}: pid {proc.pid} (generation {self.generation}, warm spare {spare})")
        else:
            env = self._env(RANK=str(rank), LOCAL_RANK=str(rank), **{membership.ENV_GENERATION: str(self.generation)})
            self.workers[rank] = subprocess.Popen([sys.executable, *self.command], env=env)
            self.say(f"rank {rank}: pid {self.workers[rank].pid} (generation {self.generation})")
        self.pending[rank] = self.workers[rank].pid
        self.pending_since.setdefault(rank, time.monotonic())

    def spawn_spare(self):
        """A warm spare: the training script started (torch imported, arguments parsed) and waiting in
        Membership.from_env for the rank it is to replace."""
        self.spare_count += 1
        env = self._env(**{membership.ENV_SPARE: str(self.spare_count)})
        proc = subprocess.Popen([sys.executable, *self.command], env=env)
        self.spares.append((self.spare_count, proc))
        self.say(f"spare {self.spare_count}: pid {proc.pid}")

    def tend_spares(self):
        """Drop spares that died; start new ones, but not while a recovery is under way (on few cores a
        starting process slows the recovery down): only once an iteration after the last death was logged."""
        alive = [(i, p) for i, p in self.spares if p.poll() is None]
        if len(alive) < len(self.spares):
            self.say(f"spare(s) {[i for i, p in self.spares if p.poll() is not None]} died: no more spares")
            self.num_spares = 0  # a spare that dies waiting would die again: start replacements afresh
        self.spares = alive
        if len(self.spares) < self.num_spares:
            if self.spare_after_logged is None or membership.last_logged(self.store) > self.spare_after_logged:
                self.spare_after_logged = None
                self.spawn_spare()

    def open_generation(self, replaced, members=None, why=""):
        """Generation += 1: its members (default: the current ones), the ranks started afresh
        for it, their processes; the `generation` key last, since the new processes' environment says it."""
        self.generation += 1
        self.members = sorted(self.members if members is None else members)
        self.store.set(f"gen_{self.generation}/members", json.dumps(self.members))
        self.store.set(f"gen_{self.generation}/replaced", json.dumps(sorted(replaced)))
        for rank in replaced:
            self.spawn(rank)
        self.store.set("generation", str(self.generation))
        self.say(f"generation {self.generation}: replaced {sorted(replaced)}"
                 + (f", members {self.members}" if len(self.members) < self.world_size else "") + why)

    def start_all(self):
        """Every rank afresh, in a new generation (the first, or the whole-job restart of the fallback)."""
        self.done.clear()
        self.stop_all()
        self.workers, self.pending = {}, {}
        self.store.delete_key("finished")  # a restarted job trains anew
        self.open_generation(range(self.world_size), range(self.world_size))
        # A starting job waits for every rank (--join-timeout): only a rank lost while training can be late.
        self.pending_since = {}

    def stop_all(self):
        for _, proc in self.spares:
            proc.kill()
            proc.wait()
        self.spares = []
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.workers.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def note_standby(self):
        """Replacements that are ready to join (their pid in standby/<rank>) are no longer pending."""
        for rank, pid in list(self.pending.items()):
            key = f"standby/{rank}"
            if self.store.check([key]) and self.store.get(key).decode() == str(pid):
                del self.pending[rank]
                self.pending_since.pop(rank, None)

    def tend_elastic(self):
        """Elastic mode: shrink to the complete instances when a replacement is late, grow back when it is
        ready (see the module docstring). Instances are whole: their ranks' shard positions stay the same."""
        if self.config.min_instances is None or not self.store.check(["instance_size"]):
            return
        topology = DataParallelTopology.from_instance_size(self.world_size, int(self.store.get("instance_size")))
        broken = {topology.instance(r) for r in range(self.world_size)
                  if r in self.pending or self.workers[r].poll() is not None}
        wanted = [r for r in range(self.world_size) if topology.instance(r) not in broken]
        complete = topology.num_distributed_optimizer_instances - len(broken)
        if self.store.check([f"gen_{self.generation}/ready"]):  # formed (or closed: then a newer one is open)
            if set(wanted) > set(self.members) and not self.store.check(["finished"]):
                self.grow(wanted)
            return
        late = sorted(r for r in self.pending.keys() & set(self.members) & set(self.pending_since)
                      if time.monotonic() - self.pending_since[r] > self.replacement_timeout_s)
        if late and complete >= self.config.min_instances and set(wanted) < set(self.members):
            # Close the generation unless its last member arrived meanwhile (compare_set: one of us wins).
            if self.store.compare_set(f"gen_{self.generation}/ready", "", "closed") == b"closed":
                self.open_generation([], wanted, f" (shrink: rank(s) {late} not back within "
                                                 f"{self.replacement_timeout_s} s)")

    def grow(self, members):
        """Admit the ranks of the instances that are whole again: the current members leave together after an
        iteration none of them can have completed yet. Rank 0 logs iteration L + 1 before it takes part in
        L + 2, and no rank completes L + 2 without it, so when L is read no rank has passed L + 2; a member
        that missed the key (the supervisor delayed between reading L and writing it) fails in its next
        collective and recovers exactly (docs/fault_tolerance.md, "Elastic mode")."""
        leave_at = membership.last_logged(self.store) + 2
        self.store.set(f"gen_{self.generation}/leave_at", str(leave_at))
        self.open_generation([], members, f" (grow: instance(s) back; the members leave after iteration {leave_at})")

    def finished(self) -> bool:
        """Every rank exited 0: training ended (the ranks waiting to be admitted exit once it has)."""
        return len(self.done) == self.world_size

    def run(self) -> int:
        replacements = restarts = 0
        self.start_all()
        trouble_since = finished_since = None
        while not self.finished():
            time.sleep(0.02)
            self.tend_spares()
            self.note_standby()
            if self.store.check(["finished"]) and set(self.members) <= self.done:
                # Training ended: ranks waiting to be admitted exit by themselves; one that cannot (a
                # replacement still starting, stuck) is stopped after a grace period.
                finished_since = finished_since or time.monotonic()
                if time.monotonic() - finished_since > FINISH_GRACE_S:
                    self.say(f"training finished; stopping rank(s) {sorted(set(self.workers) - self.done)}")
                    self.stop_all()
                    return 0
            dead, fallback = [], False
            for rank, proc in self.workers.items():
                code = proc.poll()
                if code is None or rank in self.done:
                    continue
                if code == EXIT_USAGE:  # every process started with this command line would fail alike
                    self.say(f"rank {rank} exited with code {code} (a usage error: the command line is wrong, see "
                             "its message above): giving up")
                    self.stop_all()
                    return code
                if code == 0:
                    self.done.add(rank)
                elif code in (EXIT_FALLBACK, 1):  # 1: this rank's own error (a Python exception), not a loss
                    fallback = True
                else:
                    dead.append(rank)
            if fallback:
                if restarts >= self.max_restarts:
                    self.say("live recovery is impossible and no restart is left (--max-restarts): giving up")
                    self.stop_all()
                    return 1
                restarts += 1
                self.say(f"live recovery is impossible: restarting the whole job ({restarts}/{self.max_restarts})")
                self.start_all()
                continue
            if dead:
                self.say(f"rank(s) {dead} died (exit codes {[self.workers[r].returncode for r in dead]})")
                replacements += len(dead)
                self.spare_after_logged = membership.last_logged(self.store)
                if replacements > self.max_replacements:
                    self.say(f"more than {self.max_replacements} replacements (--max-replacements): giving up")
                    self.stop_all()
                    return 1
                if set(dead) & set(self.members):
                    self.open_generation(dead)
                else:  # elastic: ranks waiting to be admitted; their replacements wait in their place
                    for rank in dead:
                        self.spawn(rank)
                trouble_since = None
            elif self.store.check([f"gen_{self.generation}/trouble"]):
                trouble_since = trouble_since or time.monotonic()
                if time.monotonic() - trouble_since > self.trouble_grace_s:  # no process died: re-form only
                    self.open_generation([])
                    trouble_since = None
            else:
                self.tend_elastic()
        return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks (one node)")
    parser.add_argument("--collective-timeout", type=float, default=LiveConfig.collective_timeout_s,
                        help="seconds before a collective fails (see membership.LiveConfig)")
    parser.add_argument("--join-timeout", type=float, default=LiveConfig.join_timeout_s,
                        help="seconds a rank waits for the next generation and its ranks")
    parser.add_argument("--max-replacements", type=int, default=20, help="ranks replaced live, in all")
    parser.add_argument("--max-restarts", type=int, default=1,
                        help="whole-job restarts when live recovery is impossible")
    parser.add_argument("--spares", type=int, default=1,
                        help="warm spare processes (torch imported, waiting for a rank): a replacement then skips "
                             "the start-up of a Python process; 0: start the replacement afresh")
    parser.add_argument("--trouble-grace", type=float, default=2.0,
                        help="seconds between a rank's failed collective and a re-forming without a death")
    parser.add_argument("--min-instances", type=int, default=None,
                        help="elastic mode (torchft's min_replicas, torchrun's --nnodes MIN:MAX, in distributed-"
                             "optimizer instances): when a replacement is not back within --replacement-timeout, "
                             "train on with the complete instances if there are at least this many, and admit the "
                             "missing one at an iteration boundary once it is back (default: not elastic, wait for "
                             "the replacement)")
    parser.add_argument("--replacement-timeout", type=float, default=10.0,
                        help="elastic mode: seconds after a rank's death (while training) before the job shrinks "
                             "without its instance, unless the replacement is ready to join; shorter than "
                             "--join-timeout (torchft Lighthouse's join_timeout)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training script and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the training script, e.g. pretrain_gpt.py ARGS")
    if not 0 < args.replacement_timeout < args.join_timeout:
        parser.error(f"--replacement-timeout ({args.replacement_timeout} s) must be > 0 and shorter than "
                     f"--join-timeout ({args.join_timeout} s): the survivors give up waiting at the join timeout")
    try:
        config = LiveConfig(args.collective_timeout, args.join_timeout, args.min_instances)
    except ValueError as e:  # its message names the field: say it with the flag's name
        parser.error(str(e).replace("min_instances", "--min-instances").replace("collective_timeout_s",
                     "--collective-timeout").replace("join_timeout_s", "--join-timeout"))
    supervisor = Supervisor(args.command, args.nproc_per_node, config, args.max_replacements, args.max_restarts,
                            args.trouble_grace, args.spares, args.replacement_timeout)
    try:
        return supervisor.run()
    finally:
        supervisor.stop_all()


if __name__ == "__main__":
    sys.exit(main())
