"""The live soak (`python examples/fault_tolerance_soak.py --live`): kill ranks of one running job, one at a
time, under the live-recovery supervisor, and compare with the restart-everything path on the same kills.

One live job (dp=4, R=2, the soak's GPT) under `python -m megatron_lite.fault_tolerance.launch`; at --kills
random iterations, spaced so that each recovery completes before the next kill, one rank (every rank equally
often) is killed with SIGKILL. Per kill: whether the other ranks kept their processes (the supervisor prints
each process it starts), the iterations lost, the seconds from the kill to the first iteration completed
after it, and the recovery split from the ranks' recovery lines:

    detection       the kill -> the last survivor's failed collective (gloo: at once for a direct peer of
                    the dead rank; the collective timeout for one blocked behind another survivor)
    join            -> every rank of the new generation arrived and the gloo groups formed (includes the
                    replacement's start-up: importing torch, which overlaps the detection)
    heal            -> the model, optimizer and scheduler rebuilt, the state agreed and the shard sent
    redo            -> the interrupted iteration completed

The whole job's losses and its final checkpoint are compared bitwise with an uninterrupted run. Then the
same kills (rank, iteration) are run on the restart-everything path (torchrun --max-restarts, last words),
one job per kill, and a double failure (ranks 1 and 3 at once) on the live path.

Last, elastic mode (--elastic-kills, `launch --min-instances 1 --replacement-timeout 0.5 --spares 0`): one job
of 20 + 100 x --elastic-kills iterations, killed --elastic-kills times; each replacement is a cold process
(~3 s to import torch on these cores), later than the timeout, so the job shrinks to the complete instance,
then grows back when the replacement is ready. Per kill: the kill -> the first iteration of the shrunk job, the
iterations it trained at dp=2, and the pause of the grow (the members leaving -> the first iteration of the
whole job). The losses and final weights are compared with the uninterrupted run's, against what an
uninterrupted run at dp=2 differs from it by.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from fault_tolerance_soak import MODEL, REPO, WORLD, outputs, records, reference_losses, trial, wait_for

ELASTIC = ["--min-instances", "1", "--replacement-timeout", "0.5", "--spares", "0"]
"""The supervisor's flags of the elastic job."""


def launch_live(directory: str, iters: int, save_interval: int, collective_timeout,
                supervisor_flags=()) -> subprocess.Popen:
    """The live job; `collective_timeout` None: the supervisor's default."""
    timeout = [] if collective_timeout is None else ["--collective-timeout", str(collective_timeout)]
    cmd = [sys.executable, "-m", "megatron_lite.fault_tolerance.launch", f"--nproc-per-node={WORLD}",
           *timeout, "--max-restarts", "1", *supervisor_flags,
           os.path.join(REPO, "pretrain_gpt.py"),
           *MODEL, "--train-iters", str(iters), "--num-distributed-optimizer-instances", "2", "--save", directory,
           "--load", directory, "--save-interval", str(save_interval)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    # O_APPEND ("a", the directory is new): every write of the supervisor and its ranks lands whole at the end
    return subprocess.Popen(cmd, stdout=open(os.path.join(directory, "log.txt"), "a"), stderr=subprocess.STDOUT,
                            env=env, cwd=REPO, start_new_session=True)


def processes(log: str) -> dict:
    """rank -> [pid of every process the supervisor started for it, in order]."""
    pids = {}
    for rank, pid in re.findall(r"\[supervisor\] rank (\d+): pid (\d+)", log):
        pids.setdefault(int(rank), []).append(int(pid))
    return pids


def recoveries(log: str) -> dict:
    """generation -> the ranks' recovery records (live_training._report). Each rank writes its record as one
    line in one write(), but the ranks share the output with the supervisor and with native libraries (gloo's
    warnings), so the records are found anywhere in the log, and one that is not whole JSON is left out."""
    out = {}
    for text in re.findall(r"> recovered into generation \d+: (\{[^{}]*\})", log):
        try:
            record = json.loads(text)
        except ValueError:
            continue
        if isinstance(record, dict) and "generation" in record:
            out.setdefault(record["generation"], []).append(record)
    return out


def split(records_of_generation: list, killed_at: float) -> dict:
    """The recovery's phases in seconds (see the module docstring), over every rank of the generation. A phase
    is None when a rank has no mark for its end: a generation with nothing to heal (a re-forming before any
    rank held state starts afresh: no 'healed'), or no survivor (no 'failed')."""
    def last(key, records):
        values = [r.get(key) for r in records]
        return max(values) if values and None not in values else None

    every = records_of_generation
    ends = [killed_at, last("failed", [r for r in every if r.get("role") == "survivor"]), last("joined", every),
            last("healed", every), last("redone", every)]
    return {phase: None if start is None or end is None else round(end - start, 2)
            for phase, start, end in zip(("detection", "join", "heal", "redo"), ends, ends[1:])}


def live_job(out: str, name: str, iters: int, save_interval: int, kills: list, collective_timeout: float,
             ranks_at_once: int = 1) -> tuple:
    """Run one live job, killing kills[i] = (iteration, [ranks]) in turn. Returns (rows, log, directory)."""
    directory = os.path.join(out, name)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    log_path = os.path.join(directory, "log.txt")
    metrics = os.path.join(directory, "metrics.jsonl")
    job = launch_live(directory, iters, save_interval, collective_timeout)
    watched = outputs(directory)
    rows = []
    try:
        for kill_at, ranks in kills:
            wait_for(lambda: (records(metrics) or [{"iteration": 0}])[-1]["iteration"] >= kill_at, job, watched,
                     f"iteration {kill_at}")
            with open(log_path) as f:
                text = f.read()
            before_pids, before_generation = processes(text), max(recoveries(text), default=0)
            for rank in ranks:
                os.kill(before_pids[rank][-1], signal.SIGKILL)
            killed_at = time.time()
            before = records(metrics)
            first = wait_for(lambda: (records(metrics)[len(before):] or [None])[0], job, watched, "an iteration")
            seconds = time.time() - killed_at
            generation = None  # a double failure ends in a whole-job restart: no recovery record
            if len(ranks) == 1:  # the recovery's records (the generation that healed: a spurious timeout while
                # healing adds one) reach the log before the next kill
                generation = wait_for(lambda: max(recoveries(open(log_path).read()), default=0) > before_generation
                                      and max(recoveries(open(log_path).read())), job, watched, "the recovery record")
            rows.append({"kill": len(rows), "rank": ",".join(map(str, ranks)), "completed": before[-1]["iteration"],
                         "resumed": first["iteration"] - 1, "seconds": round(seconds, 2), "killed_at": killed_at,
                         "pids_before": before_pids, "generation": generation})
        code = wait_for(None, job, watched, "the end of the job")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    with open(log_path) as f:
        log = f.read()
    after_pids, splits = processes(log), recoveries(log)
    for k, row in enumerate(rows):
        killed, generation = {int(r) for r in row["rank"].split(",")}, row["generation"]
        # The other ranks' processes until the next kill (or the end) are the ones before this kill.
        pids_next = rows[k + 1]["pids_before"] if k + 1 < len(rows) else after_pids
        row["healthy_pids_kept"] = code == 0 and all(pids_next[r] == row["pids_before"][r]
                                                     for r in range(WORLD) if r not in killed)
        row["lost"] = max(0, row["completed"] - row["resumed"])
        row["split"] = split(splits[generation], row["killed_at"]) if generation in splits else None
    return rows, log, directory, code


def elastic_job(out: str, iters: int, save_interval: int, kills: list, collective_timeout: float) -> tuple:
    """One elastic job, killing kills[i] = (iteration, rank) in turn, each after the previous grow. Returns
    (rows, directory, exit code)."""
    directory = os.path.join(out, "elastic")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    log_path, metrics = os.path.join(directory, "log.txt"), os.path.join(directory, "metrics.jsonl")
    job = launch_live(directory, iters, save_interval, collective_timeout, ELASTIC)
    watched = outputs(directory)
    grows = lambda: re.findall(r"generation (\d+): replaced \[\] \(grow: .* after iteration (\d+)\)",  # noqa: E731
                               open(log_path).read())
    rows = []
    try:
        for kill_at, rank in kills:
            wait_for(lambda: (records(metrics) or [{"iteration": 0}])[-1]["iteration"] >= kill_at, job, watched,
                     f"iteration {kill_at}")
            grown = len(grows())
            os.kill(processes(open(log_path).read())[rank][-1], signal.SIGKILL)
            killed_at, before = time.time(), records(metrics)
            first = wait_for(lambda: (records(metrics)[len(before):] or [None])[0], job, watched, "an iteration")
            shrunk_s = time.time() - killed_at
            generation, leave_at = map(int, wait_for(lambda: grows()[grown:] and grows()[grown], job, watched,
                                                     "the grow"))
            wait_for(lambda: len(recoveries(open(log_path).read()).get(generation, [])) == WORLD, job, watched,
                     "the grown job")  # every rank's record of the grow: the next kill comes after it
            rows.append({"kill": len(rows), "rank": rank, "completed": before[-1]["iteration"],
                         "resumed": first["iteration"] - 1, "shrunk_s": round(shrunk_s, 2), "leave_at": leave_at})
        code = wait_for(None, job, watched, "the end of the job")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    log = open(log_path).read()
    shrinks = re.findall(r"generation (\d+): replaced \[\], members (\[[\d, ]+\]) \(shrink", log)
    grow_generations = [records_ for _, records_ in sorted(recoveries(log).items())
                        if any(r["role"] == "grow" for r in records_)]
    for k, row in enumerate(rows):
        row["shrunk_to"] = shrinks[k][1] if k < len(shrinks) else None
        row["iterations_shrunk"] = row["leave_at"] - row["resumed"]
        grow = grow_generations[k] if k < len(grow_generations) else None
        row["grow_pause_s"] = None if grow is None else round(
            max(r["redone"] for r in grow) - min(r["failed"] for r in grow if r["role"] == "grow"), 2)
    return rows, directory, code


def deviation(directory: str, reference: dict, reference_directory: str, iters: int) -> tuple:
    """(max relative loss difference, max absolute final weight difference) against the uninterrupted run."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from checkpoint_convert import read

    seen = {}
    for r in records(os.path.join(directory, "metrics.jsonl")):
        seen.setdefault(r["iteration"], []).append(r["lm_loss"])
    if sorted(seen) != list(range(1, iters + 1)):
        return float("inf"), float("inf")
    loss = max(abs(v - reference[i]) / abs(reference[i]) for i, values in seen.items() for v in values)
    final, expected = (read(os.path.join(d, f"iter_{iters:07d}"))["model"] for d in (directory, reference_directory))
    weights = max((final[k].float() - expected[k].float()).abs().max().item() for k in expected)
    return loss, weights


def same_losses(directory: str, reference: dict, iters: int) -> bool:
    seen = {}
    for r in records(os.path.join(directory, "metrics.jsonl")):
        seen.setdefault(r["iteration"], set()).add(r["lm_loss"])
    return sorted(seen) == list(range(1, iters + 1)) and all(seen[i] == {reference[i]} for i in seen)


def same_weights(directory: str, reference_directory: str, iters: int) -> bool:
    def files(d):
        folder = os.path.join(d, f"iter_{iters:07d}")
        return {n: open(os.path.join(folder, n), "rb").read() for n in os.listdir(folder) if n.endswith(".distcp")}
    return files(directory) == files(reference_directory)


def main(args, rng, reference: dict):
    # Iterations between kills (at least 8: each recovery completes before the next kill); the longer, the
    # likelier the warm spare started after one recovery is ready at the next kill.
    gap = max(8, (args.iters - 15) // max(args.kills, 1))
    if args.iters < 15 + gap * args.kills:
        raise SystemExit(f"--live needs --iters >= {15 + gap * args.kills} for {args.kills} spaced kills")
    points = [5 + k * gap + rng.randint(0, gap // 2) for k in range(args.kills)]
    ranks = []  # every rank equally often: each round of WORLD kills is a permutation
    while len(ranks) < args.kills:
        ranks += rng.sample(range(WORLD), WORLD)
    kills = [(point, [rank]) for point, rank in zip(points, ranks)]
    reference_dir = os.path.join(args.out, "reference_r2")
    rows, log, directory, code = live_job(args.out, "live", args.iters, args.save_interval, kills,
                                          args.collective_timeout)
    identical = code == 0 and same_losses(directory, reference, args.iters) and \
        same_weights(directory, reference_dir, args.iters)
    print("\n### live recovery (one job, dp=4, R=2, supervisor: only the killed rank restarts)\n")
    print("| kill | rank | completed | resumed from | lost | healthy PIDs kept | kill -> first iteration (s) | "
          "detection | join | heal | redo |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["split"] or {}
        print(f"| {r['kill']} | {r['rank']} | {r['completed']} | {r['resumed']} | {r['lost']} | "
              f"{'yes' if r['healthy_pids_kept'] else 'NO'} | {r['seconds']} | {s.get('detection')} | "
              f"{s.get('join')} | {s.get('heal')} | {s.get('redo')} |")
    mean = sum(r["seconds"] for r in rows) / len(rows)
    print(f"live: {len(rows)} kills, iterations lost {sum(r['lost'] for r in rows)}, mean kill -> first iteration "
          f"{mean:.2f} s (min {min(r['seconds'] for r in rows)}, max {max(r['seconds'] for r in rows)}); every loss "
          f"and the final weights bit-identical to the uninterrupted run: {'yes' if identical else 'NO'}")

    print("\n### restart everything (torchrun --max-restarts 1, last words), the same kills, one job each\n")
    restart_rows = []
    for k, (point, ranks_) in enumerate(kills[:args.restart_kills]):
        restart_rows.append(trial(args.out, f"restart{k}", args.iters, 2, args.save_interval, point, ranks_, reference))
        print(json.dumps(restart_rows[-1]), flush=True)
    if restart_rows:
        print(f"restart everything: {len(restart_rows)} kills, iterations lost "
              f"{sum(r['lost'] for r in restart_rows)}, mean kill -> first iteration "
              f"{sum(r['recovery_s'] for r in restart_rows) / len(restart_rows):.2f} s, every process restarted")

    print("\n### double failure (ranks 1 and 3, both holders of shard 1, at once), live path\n")
    at = rng.randint(args.save_interval + 5, args.iters - 10)
    double, double_log, double_dir, double_code = live_job(args.out, "live_double", args.iters, args.save_interval,
                                                           [(at, [1, 3])], args.collective_timeout)
    d = double[0]
    message = next((line.split("> ", 1)[1] for line in double_log.splitlines() if "has no replica" in line), "")
    resumed = next((line for line in double_log.splitlines() if "> resumed from" in line), "")
    double_identical = double_code == 0 and same_losses(double_dir, reference, args.iters)
    print(f"killed at iteration {d['completed']}: resumed from {d['resumed']} (lost {d['lost']}), kill -> first "
          f"iteration {d['seconds']} s; message: {message}; {resumed.strip()}; losses bit-identical: "
          f"{'yes' if double_identical else 'NO'}")
    ok = identical and all(r["lost"] == 0 and r["healthy_pids_kept"] for r in rows) and double_identical \
        and "has no replica" in message and all(r["identical"] for r in restart_rows)
    if args.elastic_kills:
        ok = elastic_soak(args, rng) and ok
    print("live soak:", "PASSED" if ok else "FAILED")
    return ok


def elastic_soak(args, rng) -> bool:
    """The elastic part (see the module docstring): kills spread over a job of its own (100 iterations per kill:
    a cold replacement takes ~3 s, dozens of iterations, to come back), each after the previous grow. The
    yardstick for "the same up to the order of the sums" is an uninterrupted run at dp=2 (one instance): the
    same samples, summed in the shrunk job's order throughout."""
    out, iters = os.path.join(args.out, "elastic"), 20 + 100 * args.elastic_kills
    reference, reference_dir = reference_losses(out, iters, 2), os.path.join(out, "reference_r2")
    reference_losses(out, iters, 1, nproc=WORLD // 2)
    gap = (iters - 20) // args.elastic_kills
    kills = [(5 + k * gap + rng.randint(0, gap // 4), rng.randrange(WORLD)) for k in range(args.elastic_kills)]
    rows, directory, code = elastic_job(out, iters, args.save_interval, kills, args.collective_timeout)
    order = deviation(os.path.join(out, "reference_r1_dp2"), reference, reference_dir, iters)
    loss, weights = deviation(directory, reference, reference_dir, iters) if code == 0 else (None, None)
    print("\n### elastic (one job, `launch --min-instances 1 --replacement-timeout 0.5 --spares 0`)\n")
    print("| kill | rank | completed | resumed from | shrunk to | kill -> first iteration (s) | iterations at dp=2 "
          "| grow pause (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kill']} | {r['rank']} | {r['completed']} | {r['resumed']} | {r['shrunk_to']} | {r['shrunk_s']} "
              f"| {r['iterations_shrunk']} | {r['grow_pause_s']} |")
    ok = code == 0 and len(rows) == args.elastic_kills and all(r["shrunk_to"] and r["completed"] == r["resumed"]
                                                                for r in rows)
    # Within twice what the order of the sums alone does over the whole run (and test_elastic.py's tolerance).
    ok = ok and loss is not None and loss <= max(1e-6, 2 * order[0]) and weights <= max(2e-5, 2 * order[1])
    if loss is None:
        print(f"elastic: the job failed (exit code {code}): see {directory}/log.txt")
        return False
    print(f"elastic: {len(rows)} kills, each shrunk and grown back, iterations lost "
          f"{sum(r['completed'] - r['resumed'] for r in rows)}; vs the uninterrupted run (dp=4, R=2): losses within "
          f"{loss:.2e} relative, final weights within {weights:.2e} absolute; an uninterrupted run at dp=2 differs "
          f"from it by {order[0]:.2e} and {order[1]:.2e}: {'within twice that' if ok else 'NOT within twice that'}")
    return ok
