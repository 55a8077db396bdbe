"""ZeRO-3 for a GPT whose full fp32 training state does not fit a rank's memory budget: built on the meta
device, loaded sharded, trained under the budget on every rank; per-rank peak memory next to theory.

Three runs of `--world-size` (4) spawned gloo ranks, each measured per rank with peak_rss.py (peak RSS of a
phase above the rank's RSS before the model existed):

    meta    build inside meta_device_init() + wrap (optim_grads_params) + optimizer; the first iteration; the
            steady state (the following iterations); then a torch_dist checkpoint is saved
    load    a second meta build that loads that checkpoint (--load's path), then one iteration
    normal  the same model built normally and wrapped, then trained like the meta run (its whole-run peak is
            what the budget is to separate from the meta run's)

Theory, per rank (bytes; N parameters, d ranks, s = this rank's shard elements, about N / d):

    build        4 s (parameter shards; gradient shards come with the first backward) + B (one bucket's
                 shard, built one at a time) + T (the largest tensor of the replayed initialization) + C
    load         4 s (parameter shards) + 16 s (the pieces read: main params, Adam's moments and
                 model shards; the first and last are copied in once every rank read all of its own, the moments
                 become the optimizer's state as they are)                                         + C
    iteration    16 s + W + A + O                                                                  + C
    normal build 4 N (the whole fp32 model; the wrap frees it bucket by bucket as it takes the shards, which
                 never add to it for d >= 2) + B                                                  + C
      W = the gathered and full-size storages the prefetch window allows, with their scratch:
          parameters  R + (1 + PREFETCH) U          the root unit (embeddings, final norm: gathered for the
                                                    whole iteration), the unit computing, the one prefetched
          gradients   3 R + (1 + IN_FLIGHT) U       the root's bucket and the tied embedding's two gradients
                                                    (input and output uses) that autograd sums before they are
                                                    added in; the unit computing and ZERO3_BUCKETS_IN_FLIGHT
                                                    reduce-scatters in flight
          scratch     (1 + IN_FLIGHT) U (d = 2: U / 2)  the reduce-scatters' received copies (gloo's all-gather
                                                    lands in place: no scratch; collectives.py)
          with U the largest unit's bytes (a transformer layer) and R the root's
      A = tokens x (68 h L + 8 V): the activations this GPT's autograd saves in fp32 (per layer and token
          17 h values: LayerNorm inputs and outputs, q/k/v, attention output, MLP input, 4h GELU input and
          output) and the logits with their log-softmax
      O = 4 s: torch's foreach AdamW step (one shard-sized temporary, the square root of the second moment);
          2 x the largest shard piece with the single-tensor step (`per_tensor_adam`, the wide model)
      C = what the process maps on first use whatever the model's size (library code, threads, gloo's
          connections and buffers, autograd's state, the allocator's slack): measured first, as the peak of the
          same build and three iterations of a GPT of one tiny layer (the `calibration` run) at the same dp

The budget is a per-rank limit on that peak, below the full fp32 training state (16 N bytes: parameters,
gradients, Adam's two moments). Run from the repository root:

    python -m benchmarks.zero3_scale               # GPT 42M parameters, budget 512 MiB, dp=4 (~1 min, 2 cores)
    python -m benchmarks.zero3_scale --model wide  # GPT 76M in 96 thin layers, budget 302 MiB, dp=8 (~4-7 min):
                                                   # the normal build exceeds the budget, the meta build does not
    python -m benchmarks.zero3_scale --quick       # a small GPT, for tests/bench (~40 s; --world-size 2 ~50 s)

At dp <= 4 with fp32 Adam the normal build cannot exceed a budget the training fits in: the sharded state alone
is 16/d >= 4 B/param, the whole fp32 model's size, and the iterations add the window and activations to it. At
dp=8 the sharded state is 2 B/param, the load 20/8 = 2.5 B/param, against the normal build's 4 B/param.
"""

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks import peak_rss
from benchmarks.launch import launch, world_size
from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
    meta_device_init,
)
from megatron_lite.checkpointing import load_checkpoint, save_checkpoint
from megatron_lite.distributed import collectives
from megatron_lite.distributed.grad_sync import ZERO3_BUCKETS_IN_FLIGHT
from megatron_lite.distributed.prefetch import PREFETCH
from megatron_lite.models import GPTConfig, GPTModel
from megatron_lite.training.scheduler import OptimizerParamScheduler

MiB = 2 ** 20

MODELS = {
    "full": dict(num_layers=12, hidden_size=512, num_attention_heads=8, vocab_size=8192, seq=64, budget_mb=512,
                 world=4),
    "quick": dict(num_layers=6, hidden_size=256, num_attention_heads=4, vocab_size=4096, seq=32, budget_mb=160,
                  world=4),
    # Many thin layers and a small vocabulary: the gathered window and the activations are small next to the
    # shards; Adam steps tensor by tensor (no shard-sized temporary). At dp=8 the sharded state is 2 B/param,
    # half the 4 B/param of the fp32 weights a normal build holds (see the module docstring).
    "wide": dict(num_layers=96, hidden_size=256, num_attention_heads=4, vocab_size=1024, seq=8, budget_mb=302,
                 world=8, per_tensor_adam=True),
    "calibration": dict(num_layers=1, hidden_size=64, num_attention_heads=2, vocab_size=256, seq=8, budget_mb=0),
}


def gpt_config(shape) -> GPTConfig:
    return GPTConfig(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                     num_attention_heads=shape["num_attention_heads"], vocab_size=shape["vocab_size"],
                     max_position_embeddings=shape["seq"])


# ------------------------------------------------------------------------------------------------ building
def build(shape, meta: bool, lr: float = 1e-4):
    """(ddp, optimizer, scheduler): the GPT on the meta device (materialized by the wrapper) or built normally,
    under ZeRO-3 with one unit per transformer layer."""
    torch.manual_seed(1234)
    if meta:
        with meta_device_init():
            model = GPTModel(gpt_config(shape))
    else:
        model = GPTModel(gpt_config(shape))
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
        use_distributed_optimizer=True, fsdp_unit_modules=("TransformerLayer",)))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=lr, use_distributed_optimizer=True), [ddp])
    if shape.get("per_tensor_adam"):  # torch's single-tensor AdamW: temporaries of one main tensor at a time
        for group in optimizer.optimizer.param_groups:
            group["foreach"] = False
    scheduler = OptimizerParamScheduler(optimizer, lr, lr, 0, 100, "constant")
    return ddp, optimizer, scheduler


def train_step(ddp, optimizer, shape, step: int) -> float:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(0, shape["vocab_size"], (1, shape["seq"]), generator=gen)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(tokens, labels=torch.roll(tokens, -1, 1)).mean()
    loss.backward()
    ddp.finish_grad_sync()
    optimizer.step()
    return loss.item()


# ------------------------------------------------------------------------------------------------ theory
def theory(ddp, shape, constant: int) -> dict:
    """Bytes per phase (module docstring), from this rank's buckets."""
    units = ddp.param_sync
    world = ddp.data_parallel_world_size
    shard = sum(b.shard_size for b in units.all_buckets())
    unit = max(sum(b.grad_data.numel() for b in units.buckets[i]) for i in range(len(units.units))) * 4
    root = sum(b.grad_data.numel() for b in units.root) * 4
    bucket = max(b.shard_size for b in units.all_buckets()) * 4
    largest = max(p.numel() for p in ddp.module.parameters()) * 4
    h, layers, vocab = shape["hidden_size"], shape["num_layers"], shape["vocab_size"]
    activations = shape["seq"] * (68 * h * layers + 8 * vocab)
    window = (root + (1 + PREFETCH) * unit  # parameters
              + 3 * root + (1 + ZERO3_BUCKETS_IN_FLIGHT) * unit  # gradients
              + (1 + ZERO3_BUCKETS_IN_FLIGHT) * (unit // 2 if world == 2 else unit))  # scratch
    step = 8 * max(b.shard_size for b in units.all_buckets()) if shape.get("per_tensor_adam") else 4 * shard
    iteration = 16 * shard + window + activations + step + constant
    full = sum(p.numel() for p in ddp.module.parameters()) * 4
    return {"build": 4 * shard + bucket + largest + constant, "load": 20 * shard + constant,
            "normal build": full + bucket + constant,
            "first iteration": iteration, "steady state": iteration,
            "terms": dict(shard_state=16 * shard, window=window, activations=activations, adam_step=step,
                          constant=constant)}


# ------------------------------------------------------------------------------------------------ the runs
def run_calibration(args, rank, world, device):
    """C: the peak of a meta build and three iterations of a GPT of one tiny layer."""
    shape = MODELS["calibration"]
    baseline = peak_rss.rss()
    with peak_rss.phase() as peak:
        ddp, optimizer, _ = build(shape, meta=True)
        for step in range(3):
            train_step(ddp, optimizer, shape, step)
    everyone = collectives.all_gather_object(peak.bytes - baseline)
    if rank == 0:
        with open(os.path.join(os.path.dirname(args.checkpoint_dir), "constant.json"), "w") as f:
            json.dump(max(everyone), f)


def run_meta(args, rank, world, device):
    shape = MODELS[args.model]
    baseline = peak_rss.rss()
    with peak_rss.phase() as peak:
        ddp, optimizer, scheduler = build(shape, meta=True)
    peaks, losses = _train(ddp, optimizer, shape, args.steps, {"build": peak.bytes})
    save_checkpoint(args.checkpoint_dir, args.steps, ddp, optimizer, scheduler, args.steps, ckpt_format="torch_dist")
    _report(args, "meta", rank, baseline, peaks, theory(ddp, shape, args.constant), losses)


def _train(ddp, optimizer, shape, steps: int, peaks: dict):
    """The first iteration and the steady state (the following iterations), each a phase: (peaks, losses)."""
    losses = []
    with peak_rss.phase() as peak:
        losses.append(train_step(ddp, optimizer, shape, 0))
    peaks["first iteration"] = peak.bytes
    with peak_rss.phase() as peak:
        for step in range(1, steps):
            losses.append(train_step(ddp, optimizer, shape, step))
    peaks["steady state"] = peak.bytes
    return peaks, losses


def run_load(args, rank, world, device):
    shape = MODELS[args.model]
    baseline = peak_rss.rss()
    ddp, optimizer, scheduler = build(shape, meta=True)
    peaks = {}
    with peak_rss.phase() as peak:
        load_checkpoint(args.checkpoint_dir, ddp, optimizer, scheduler, load_rng=False)
    peaks["load"] = peak.bytes
    losses = [train_step(ddp, optimizer, shape, args.steps)]
    _report(args, "load", rank, baseline, peaks, theory(ddp, shape, args.constant), losses)


def run_normal(args, rank, world, device):
    """The same model built normally, then trained like the meta run: its whole-run peak is what the meta
    build is compared against (training, with the same shards, peaks alike in both runs)."""
    shape = MODELS[args.model]
    baseline = peak_rss.rss()
    with peak_rss.phase() as peak:
        ddp, optimizer, _ = build(shape, meta=False)
    peaks, losses = _train(ddp, optimizer, shape, args.steps, {"build": peak.bytes})
    expected = theory(ddp, shape, args.constant)
    _report(args, "normal", rank, baseline, peaks, dict(expected, build=expected["normal build"]), losses)


def _report(args, run, rank, baseline, peaks, expected, losses):
    """Rank 0 prints every rank's peaks (above its baseline) next to theory and the budget, and keeps them for
    the verdict (results.json next to the checkpoint)."""
    everyone = collectives.all_gather_object({k: v - baseline for k, v in peaks.items()})
    if rank:
        return
    with open(os.path.join(os.path.dirname(args.checkpoint_dir), "results.json"), "a") as f:
        f.write(json.dumps({"run": run, "peaks": {phase: [r[phase] for r in everyone] for phase in peaks},
                            "losses": losses}) + "\n")
    budget = MODELS[args.model]["budget_mb"] * MiB
    for phase in peaks:
        values = [r[phase] for r in everyone]
        within = all(v <= budget for v in values)
        print(f"  {run:6s} {phase:16s} peak per rank (MiB): {' '.join(f'{v / MiB:6.1f}' for v in values)} | "
              f"theory {expected[phase] / MiB:6.1f} | budget {budget / MiB:.0f}: "
              f"{'within' if within else 'EXCEEDED'}", flush=True)
    if run == "meta":
        print("         theory terms (MiB): " + ", ".join(f"{k} {v / MiB:.1f}" for k, v in expected["terms"].items())
              + f" | losses {' '.join(f'{x:.4f}' for x in losses)}", flush=True)
    if run == "load":
        print(f"         loss after loading: {losses[0]:.4f}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small GPT, for the smoke test (--model quick)")
    parser.add_argument("--model", choices=["full", "quick", "wide"], default="full",
                        help="full: 42M parameters, dp=4; wide: 76M parameters in 96 thin layers, dp=8, where the "
                             "normal build exceeds the budget")
    parser.add_argument("--world-size", type=int, help="ranks to spawn (gloo, CPU; default: the model's, 4 or 8)")
    parser.add_argument("--steps", type=int, default=3, help="training iterations of the meta run")
    parser.add_argument("--budget-mb", type=int, help="the per-rank budget in MiB (default: the model's)")
    args = parser.parse_args(argv)
    args.model = "quick" if args.quick else args.model
    if not peak_rss.available():
        raise SystemExit("zero3_scale: needs Linux's /proc/self/clear_refs to reset the peak RSS")
    shape = MODELS[args.model]
    if args.budget_mb is not None:
        shape["budget_mb"] = args.budget_mb
    n = sum(p.numel() for p in _meta_model(shape).parameters())
    world = world_size(args.world_size or shape["world"])
    print(f"GPT {shape['num_layers']} layers, hidden {shape['hidden_size']}, vocab {shape['vocab_size']}, "
          f"seq {shape['seq']}: {n / 1e6:.1f}M parameters; full fp32 training state 16 B/param = "
          f"{16 * n / MiB:.0f} MiB; budget {shape['budget_mb']} MiB per rank; dp={world} (gloo, CPU); "
          f"peaks: RSS above each rank's RSS before the model", flush=True)
    # glibc's malloc would keep freed tensors' memory in its arenas (its mmap threshold grows with the
    # sizes freed): every allocation of 64 KiB or more mapped on its own, so RSS follows the live tensors.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zero3_scale_") as tmp:
        args.checkpoint_dir = os.path.join(tmp, "ckpt")
        launch(run_calibration, args, world, cpu=True)
        with open(os.path.join(tmp, "constant.json")) as f:
            args.constant = json.load(f)
        print(f"C (calibration: a one-layer GPT's build and 3 iterations): {args.constant / MiB:.1f} MiB", flush=True)
        for run in (run_meta, run_load, run_normal):
            launch(run, args, world, cpu=True)
        with open(os.path.join(tmp, "results.json")) as f:
            results = [json.loads(line) for line in f]
    verdict(results, shape, n)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


def verdict(results, shape, n) -> bool:
    """Print whether the meta-built model trained under the budget on every rank and in every phase, and
    whether the normally built run exceeded it on every rank (and which of its phases peaked); returns the
    first."""
    budget = shape["budget_mb"] * MiB
    sharded = max(v for r in results if r["run"] != "normal" for values in r["peaks"].values() for v in values)
    normal = next(r["peaks"] for r in results if r["run"] == "normal")
    per_rank = [max(values[rank] for values in normal.values()) for rank in range(len(normal["build"]))]
    built = max(normal["build"])
    trained = max(max(values) for phase, values in normal.items() if phase != "build")
    full = 16 * n
    print(f"meta-built ZeRO-3: largest peak of any rank and phase {sharded / MiB:.1f} MiB "
          f"{'<=' if sharded <= budget else '>'} budget {budget / MiB:.0f} MiB "
          f"{'<' if budget < full else '>='} full fp32 training state {full / MiB:.0f} MiB", flush=True)
    exceeded = min(per_rank) > budget
    print(f"normally built, same training: peak per rank (MiB) {' '.join(f'{v / MiB:.1f}' for v in per_rank)}: "
          f"{'EXCEEDS the budget on every rank' if exceeded else 'not above the budget on every rank'} "
          f"(its build {built / MiB:.1f}, its iterations {trained / MiB:.1f})", flush=True)
    if not exceeded:
        print("  the build holds the fp32 weights, 4 B/param; the iterations the sharded state, 16/d B/param, plus the "
              "gathered window, activations and Adam's temporary: at d <= 4 the iterations peak above the build, in "
              "both runs alike (docs/sharding_strategies.md, 'Models larger than one rank')", flush=True)
    return sharded <= budget


def _meta_model(shape) -> GPTModel:
    with torch.device("meta"):
        return GPTModel(gpt_config(shape))


if __name__ == "__main__":
    main()
