"""Kill ranks of a running job at random and check that it recovers by itself, losing nothing.

    python examples/fault_tolerance_soak.py [--kills 10] [--seed 0] [--iters 120] [--out runs/soak]
    python examples/fault_tolerance_soak.py --live [--kills 10] [--iters 120] [--elastic-kills 3]
                                                            # live recovery and elastic mode: live_soak.py
    python examples/fault_tolerance_soak.py --live --nodes 3 [--kills 10]
                                                            # nodes lost, hung, cut off: cluster_soak.py

For each trial a `torchrun --nproc-per-node 4 --max-restarts 1` job (dp=4, a small GPT on CPU/gloo,
periodic checkpoints every --save-interval iterations) is started; when its metrics file reaches a random
iteration one random rank is killed with SIGKILL. torchrun tears the job down (SIGTERM to the survivors,
who write their last words) and starts it again, which resumes with --load. Each kill is run twice: with
replicated optimizer state (--num-distributed-optimizer-instances 2) and without (1), so the table shows
what the replicas buy. A last trial kills both holders of one shard (ranks 1 and 3) at once: the last
words are then incomplete and the job must fall back to the periodic checkpoint, saying so.

Per trial: the iteration the job had completed when the rank died (the last one in the metrics file), the
iteration it resumed from, the iterations lost, the seconds from the kill to the first iteration completed
by the restarted job, and whether every loss logged after the restart is bit-identical to an
uninterrupted run's. Exit code 1 if a single-rank kill with replicas lost an iteration or a loss differs.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 4
MODEL = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--eval-iters", "0", "--log-interval", "20", "--use-distributed-optimizer", "--overlap-grad-reduce",
         "--ddp-bucket-size", "20000"]


def launch(save_dir: str, iters: int, instances: int, save_interval: int, log_path: str,
           script: str = os.path.join(REPO, "pretrain_gpt.py"), env: dict = None,
           nproc: int = WORLD, model: list = MODEL) -> subprocess.Popen:
    """Start the job (its own process group, so that a timeout can stop all of it); `model`: the flags before
    the run's own (MODEL; cluster_soak.py's at dp=6)."""
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=1", "--monitor-interval=0.2",
           script, *model, "--train-iters", str(iters),
           "--num-distributed-optimizer-instances", str(instances), "--save", save_dir, "--load", save_dir,
           "--save-interval", str(save_interval)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **(env or {})}
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)


def worker_pids(job: subprocess.Popen) -> dict:
    """RANK -> pid of the job's training processes (descendants of torchrun whose environment has RANK)."""
    pids = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if not descends_from(int(pid), job.pid):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ProcessLookupError):
            continue
        if b"pretrain_gpt.py" in cmdline and b"torchrun" not in cmdline and b"LOCAL_RANK" in env:
            pids[int(env[b"RANK"])] = int(pid)
    return pids


def descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the parent pid
    return False


def records(metrics: str) -> list:
    if not os.path.exists(metrics):
        return []
    with open(metrics) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [r for r in lines if "lm_loss" in r]  # one per iteration (timing records at log intervals aside)


STALL_S = 240.0
"""A job whose log and metrics have not grown for this long is taken for hung (its slowest step, a process
start or a whole-job restart, takes seconds, a minute at most on heavily loaded cores)."""


def wait_for(predicate, job, watched: list, what: str, stall_s: float = STALL_S):
    """Poll `predicate` until it returns a true value, which is returned; `predicate` None: wait for the job to
    exit, and return its code. Bounded by the job's progress, not by wall time: a TimeoutError only when none of
    the `watched` files (its log, its metrics) has grown for `stall_s` seconds, so a loaded machine slows the
    soak down but does not fail it, and a hung job still ends it."""
    sizes, last_progress = None, time.monotonic()
    while True:
        if predicate is None:
            if job.poll() is not None:
                return job.returncode
        else:
            value = predicate()
            if value:
                return value
            if job.poll() is not None:
                raise RuntimeError(f"the job ended (code {job.returncode}) while waiting for {what}")
        now = [os.path.getsize(f) if os.path.exists(f) else -1 for f in watched]
        if now != sizes:
            sizes, last_progress = now, time.monotonic()
        elif time.monotonic() - last_progress > stall_s:
            raise TimeoutError(f"waiting for {what}: the job made no progress for {stall_s:.0f} s "
                               f"({', '.join(watched)} unchanged)")
        time.sleep(0.02)


def outputs(directory: str) -> list:
    """What a job in `directory` writes as it makes progress: its log and its metrics."""
    return [os.path.join(directory, "log.txt"), os.path.join(directory, "metrics.jsonl")]


def reference_losses(out: str, iters: int, instances: int, nproc: int = WORLD, model: list = MODEL) -> dict:
    """The uninterrupted run's {iteration: loss}, written to OUT/reference_r<instances>[_dp<nproc>]."""
    directory = os.path.join(out, f"reference_r{instances}" + ("" if nproc == WORLD else f"_dp{nproc}"))
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    job = launch(directory, iters, instances, iters, os.path.join(directory, "log.txt"), nproc=nproc, model=model)
    if wait_for(None, job, outputs(directory), "the reference run") != 0:
        raise RuntimeError(f"the reference run failed: see {directory}/log.txt")
    return {r["iteration"]: r["lm_loss"] for r in records(os.path.join(directory, "metrics.jsonl"))}


def trial(out: str, name: str, iters: int, instances: int, save_interval: int, kill_at: int, ranks: list,
          reference: dict, nproc: int = WORLD, model: list = MODEL) -> dict:
    """One job killed once; returns the row of the table."""
    directory = os.path.join(out, name)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    log_path = os.path.join(directory, "log.txt")
    metrics = os.path.join(directory, "metrics.jsonl")
    job = launch(directory, iters, instances, save_interval, log_path, nproc=nproc, model=model)
    try:
        watched = outputs(directory)
        wait_for(lambda: (records(metrics) or [{"iteration": 0}])[-1]["iteration"] >= kill_at, job, watched,
                 f"iteration {kill_at}")
        pids = wait_for(lambda: (lambda p: p if len(p) == nproc else None)(worker_pids(job)), job, watched,
                        "the workers")
        for rank in ranks:
            os.kill(pids[rank], signal.SIGKILL)
        killed_at = time.time()
        before = records(metrics)
        completed = before[-1]["iteration"]
        # The restarted job logs again: an iteration that is not after the last one seen, or a new line
        # once it passes it.
        first = wait_for(lambda: (records(metrics)[len(before):] or [None])[0], job, watched, "the restarted job")
        recovery_s = time.time() - killed_at
        code = wait_for(None, job, watched, "the end of the job")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    after = records(metrics)[len(before):]
    resumed = first["iteration"] - 1
    with open(log_path) as f:
        log = f.read()
    differing = [r["iteration"] for r in after if reference.get(r["iteration"]) != r["lm_loss"]]
    skipped = [line.split("> skipping ", 1)[1] for line in log.splitlines() if "> skipping " in line]
    return {"trial": name, "R": instances, "killed": ",".join(map(str, ranks)), "completed": completed,
            "resumed": resumed, "lost": max(0, completed - resumed), "recovery_s": round(recovery_s, 1),
            "identical": not differing and code == 0 and after[-1]["iteration"] == iters,
            "from": loaded_from(log), "note": skipped[0] if skipped else ""}


def loaded_from(log: str) -> str:
    if "> resumed from" not in log:
        return "scratch"
    return "last words" if "/last_words/" in log.split("> resumed from", 1)[1].split("\n", 1)[0] else "periodic"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10,
                        help="random single-rank kills (each run with R=2 and R=1; --live: kills of the live job; "
                             "with --nodes: faults, see --nodes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iters", type=int, default=None,
                        help="iterations per job (default 120; with --nodes the job's --train-iters, default 3000: "
                             "the job is stopped a few iterations after its last fault)")
    parser.add_argument("--save-interval", type=int, default=25, help="iterations between periodic checkpoints")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "soak"))
    parser.add_argument("--live", action="store_true",
                        help="the live-recovery soak (examples/live_soak.py): one job under the supervisor that "
                             "restarts only the killed rank, then the same kills restarting everything")
    parser.add_argument("--collective-timeout", type=float, default=None,
                        help="--live: the supervisor's flag (default: the supervisor's default); not used with "
                             "--nodes (the agents keep their default)")
    parser.add_argument("--elastic-kills", type=int, default=3,
                        help="--live: kills in the elastic job (shrink, then grow back); 0: no elastic job; not used "
                             "with --nodes (no elastic job there)")
    parser.add_argument("--restart-kills", type=int, default=None,
                        help="--live: how many of the kills to rerun on the restart-everything path (default all; "
                             "with --nodes, 1: the restart path timed once on the same model; there any other value "
                             "but 0 also times it once)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="--live: the multi-node soak (examples/cluster_soak.py): this many simulated nodes of 2 "
                             "ranks (network namespaces, root) + 1 hot spare, etcd, an agent per node; its --kills "
                             "cycle over node killed, rank hung, node hung, etcd member killed, partition")
    parser.add_argument("--loopback-nodes", action="store_true",
                        help="with --nodes: nodes on 127.0.0.x instead of network namespaces (what it does by itself "
                             "where namespaces cannot be made): no partition faults")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    if args.loopback_nodes and args.nodes is None:
        parser.error("--loopback-nodes needs --nodes")
    if args.nodes is not None:
        if not args.live:
            parser.error("--nodes needs --live (the multi-node soak is a live-recovery soak)")
        if args.nodes < 3:
            parser.error(f"--nodes must be >= 3 (the etcd cluster has 3 members, one per node), got {args.nodes}")
        import cluster_soak

        args.iters = 3000 if args.iters is None else args.iters
        args.restart_kills = 1 if args.restart_kills is None else args.restart_kills
        sys.exit(0 if cluster_soak.main(args, rng) else 1)
    args.iters = 120 if args.iters is None else args.iters
    if args.live:
        import live_soak

        args.restart_kills = args.kills if args.restart_kills is None else args.restart_kills
        sys.exit(0 if live_soak.main(args, rng, reference_losses(args.out, args.iters, 2)) else 1)
    references = {r: reference_losses(args.out, args.iters, r) for r in (2, 1)}
    rows = []
    ranks = []  # random ranks, every rank equally often: each round of WORLD kills is a permutation
    while len(ranks) < args.kills:
        ranks += rng.sample(range(WORLD), WORLD)
    for k in range(args.kills):
        kill_at, rank = rng.randint(5, args.iters - 20), ranks[k]
        for instances in (2, 1):
            rows.append(trial(args.out, f"kill{k}_r{instances}", args.iters, instances, args.save_interval,
                              kill_at, [rank], references[instances]))
            print(json.dumps(rows[-1]), flush=True)
    kill_at = rng.randint(args.save_interval + 5, args.iters - 20)  # after a periodic checkpoint
    rows.append(trial(args.out, "double_r2", args.iters, 2, args.save_interval, kill_at, [1, 3], references[2]))
    print(json.dumps(rows[-1]), flush=True)

    print("\n| trial | R | killed rank(s) | completed | resumed from | lost | kill -> first iteration (s) | "
          "losses bit-identical | loaded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trial']} | {r['R']} | {r['killed']} | {r['completed']} | {r['resumed']} | {r['lost']} | "
              f"{r['recovery_s']} | {'yes' if r['identical'] else 'NO'} | {r['from']} |")
    for R in (2, 1):
        single = [r for r in rows if r["R"] == R and "," not in r["killed"]]
        mean_lost = sum(r["lost"] for r in single) / len(single)
        print(f"R={R}: {len(single)} single-rank kills, mean iterations lost {mean_lost:.1f}, "
              f"max {max(r['lost'] for r in single)}, mean kill -> first iteration "
              f"{sum(r['recovery_s'] for r in single) / len(single):.1f} s")
    double = rows[-1]
    print(f"double failure (ranks 1 and 3, both holders of shard 1): resumed from {double['from']} checkpoint at "
          f"{double['resumed']}; message: {double['note']}")
    single_kills_at_r2 = [r for r in rows if r["R"] == 2 and "," not in r["killed"]]
    ok = all(r["identical"] for r in rows) and all(r["lost"] == 0 for r in single_kills_at_r2)
    ok = ok and double["from"] == "periodic" and "survived on no rank" in double["note"]
    print("soak:", "PASSED" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
