"""The live-recovery supervisor: starts the ranks, and when one dies restarts that rank only.

    python -m megatron_lite.fault_tolerance.launch --nproc-per-node 4 [--max-replacements 20]
        [--collective-timeout 3] [--join-timeout 60] [--max-restarts 1] pretrain_gpt.py ARGS...

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
    a worker exits 3            live recovery is impossible (both holders of a shard lost), or a worker
    (EXIT_FALLBACK) or 1        raised an error of its own (a bug, a NaN: a new process would meet it again):
                                every worker is stopped (SIGTERM: last words) and the whole job restarted,
                                which resumes with --load, up to --max-restarts times (torchrun's behaviour)
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from . import membership
from .membership import EXIT_FALLBACK, LiveConfig


class Supervisor:
    """The workers of one job and the store of their generations (see the module docstring)."""

    def __init__(self, command, world_size: int, config: LiveConfig, max_replacements: int, max_restarts: int,
                 trouble_grace_s: float, spares: int = 1):
        self.command, self.world_size, self.config = command, world_size, config
        self.max_replacements, self.max_restarts, self.trouble_grace_s = max_replacements, max_restarts, trouble_grace_s
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.generation = 0
        self.workers = {}  # rank -> Popen
        self.done = set()
        self.num_spares = spares
        self.spares = []  # [(id, Popen)] warm processes waiting for a rank, oldest first
        self.spare_count = 0
        self.spare_after_logged = None  # replenish the spares once training passed this iteration again

    def say(self, text: str):
        print(f"[supervisor] {text}", flush=True)

    def _env(self, **extra) -> dict:
        return {**os.environ, "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                membership.ENV_STORE: f"127.0.0.1:{self.store.port}",
                membership.ENV_COLLECTIVE_TIMEOUT: str(self.config.collective_timeout_s),
                membership.ENV_JOIN_TIMEOUT: str(self.config.join_timeout_s), **extra}

    def spawn(self, rank: int):
        """A process for `rank` in the current generation: a warm spare if one is waiting, else a new one."""
        if self.spares:
            spare, proc = self.spares.pop(0)
            self.store.set(f"spare_{spare}/assign", json.dumps({"rank": rank, "generation": self.generation}))
            self.workers[rank] = proc
            self.say(f"rank {rank}: pid {proc.pid} (generation {self.generation}, warm spare {spare})")
            return
        env = self._env(RANK=str(rank), LOCAL_RANK=str(rank), **{membership.ENV_GENERATION: str(self.generation)})
        self.workers[rank] = subprocess.Popen([sys.executable, *self.command], env=env)
        self.say(f"rank {rank}: pid {self.workers[rank].pid} (generation {self.generation})")

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

    def new_generation(self, replaced):
        self.generation += 1
        self.store.set(f"gen_{self.generation}/replaced", json.dumps(sorted(replaced)))
        for rank in replaced:
            self.spawn(rank)
        self.store.set("generation", str(self.generation))  # after the spawns: their environment says it
        self.say(f"generation {self.generation}: replaced {sorted(replaced)}")

    def start_all(self):
        self.done.clear()
        self.store.set(f"gen_{self.generation}/replaced", json.dumps(list(range(self.world_size))))
        for rank in range(self.world_size):
            self.spawn(rank)
        self.store.set("generation", str(self.generation))

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

    def run(self) -> int:
        replacements = restarts = 0
        self.start_all()
        trouble_since = None
        while len(self.done) < self.world_size:
            time.sleep(0.02)
            self.tend_spares()
            dead, fallback = [], False
            for rank, proc in self.workers.items():
                code = proc.poll()
                if code is None or rank in self.done:
                    continue
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
                self.stop_all()
                self.generation += 1
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
                self.new_generation(dead)
                trouble_since = None
            elif self.store.check([f"gen_{self.generation}/trouble"]):
                trouble_since = trouble_since or time.monotonic()
                if time.monotonic() - trouble_since > self.trouble_grace_s:  # no process died: re-form only
                    self.new_generation([])
                    trouble_since = None
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
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training script and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the training script, e.g. pretrain_gpt.py ARGS")
    config = LiveConfig(args.collective_timeout, args.join_timeout)
    supervisor = Supervisor(args.command, args.nproc_per_node, config, args.max_replacements, args.max_restarts,
                            args.trouble_grace, args.spares)
    try:
        return supervisor.run()
    finally:
        supervisor.stop_all()


if __name__ == "__main__":
    sys.exit(main())
