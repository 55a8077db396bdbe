"""The DDP wrapper's cost on a real training step: the GPT's forward and backward, bare vs wrapped, one rank.

ddp_overhead.py magnifies the wrapper's per-parameter host work on a CPU toy model; this one asks the
question of issue 24 on the device the model trains on: how much longer is a GPT-2-125M-sized step (bf16)
inside megatron_lite's DistributedDataParallel than the same model unwrapped (goal <= 2%)? A world of one
rank: the collectives are skipped, so what remains is the wrapper's own work (grad hooks, main_grad adds in
the grad dtype, bucket bookkeeping, finish_grad_sync). Steps of the variants alternate (timing.py), each
timed wall-clock with a device synchronize; medians are reported.

    python -m benchmarks.ddp_overhead_gpt                                   # GPT-2 125M, bf16, CUDA if any
    python -m benchmarks.ddp_overhead_gpt --device cpu --quick              # a few seconds on a CPU

Variants: 'bare' (zero_grad(set_to_none), forward, backward: gradients in the parameters' dtype), 'bare +
fp32 grads' (the same plus adding every .grad into an fp32 copy, the bare equivalent of --bf16's
accumulate-in-fp32), and megatron_lite with and without overlap_grad_reduce, grad_reduce_in_fp32 as
pretrain_gpt.py --bf16 sets it, plus (bf16) megatron_lite with gradients in bf16 (--grad-reduce-in-bf16),
the like-for-like of 'bare'. With --optimizer, each variant also steps an optimizer (torch's fused AdamW
on fp32 master copies for the bare model, megatron_lite's for the wrapped ones).
"""

import torch

from benchmarks.launch import launch
from benchmarks.sized_args import parse_sized, sized_parser, write_json
from benchmarks.timing import alternate
from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_lite.models import GPTConfig, GPTModel, num_floating_point_operations
from megatron_lite.training.metrics import mfu

SIZES = dict(layers=(12, 2), hidden=(768, 64), heads=(12, 2), seq=(1024, 32), vocab=(50304, 512), micro_batch=(8, 2),
             repeats=(10, 2), steps=(3, 2), warmup=(2, 1))
"""Flag: (default, default with --quick)."""


def benchmark(args, rank, world, device):
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       vocab_size=args.vocab, max_position_embeddings=args.seq, params_dtype=dtype)

    def model():
        torch.manual_seed(0)
        gpt = GPTModel(config).to(device)
        return gpt.compile_layers() if args.compile else gpt

    tokens = torch.randint(args.vocab, (args.micro_batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    steps = {}

    bare = model()
    bare_fp32 = ({p: torch.zeros_like(p, dtype=torch.float32) for p in bare.parameters()}
                 if dtype != torch.float32 else {})
    bare_opt = None
    if args.optimizer:
        master = [g for g in bare_fp32.values()] or list(bare.parameters())
        bare_opt = torch.optim.AdamW(master, lr=1e-4, fused=device.type == "cuda", foreach=device.type != "cuda")

    def bare_step(accumulate):
        bare.zero_grad(set_to_none=True)
        bare(inputs, labels=labels).mean().backward()
        if accumulate and bare_fp32:
            torch._foreach_add_(list(bare_fp32.values()), [p.grad for p in bare_fp32])
        if bare_opt is not None:
            if bare_fp32:
                for p, g in bare_fp32.items():  # AdamW on the fp32 copies, as a stand-in for master params
                    g.grad = p.grad.float()
            bare_opt.step()

    steps["bare"] = lambda: bare_step(False)
    if bare_fp32:
        steps["bare + fp32 grads"] = lambda: bare_step(True)
    variants = [("megatron_lite, no overlap", False, True), ("megatron_lite, overlap", True, True)]
    if dtype != torch.float32:  # the like-for-like of 'bare': gradients kept in the params' dtype
        variants.append(("megatron_lite, overlap, bf16 grads", True, False))
    for name, overlap, fp32_grads in variants:
        ddp = DistributedDataParallel(model(), DistributedDataParallelConfig(
            grad_reduce_in_fp32=dtype != torch.float32 and fp32_grads, overlap_grad_reduce=overlap,
            bucket_size=args.bucket_size))
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=dtype == torch.bfloat16), [ddp]) \
            if args.optimizer else None

        def wrapped_step(ddp=ddp, opt=opt):
            ddp.zero_grad_buffer()
            ddp(inputs, labels=labels).mean().backward()
            ddp.finish_grad_sync()
            if opt is not None:
                opt.step()

        steps[name] = wrapped_step

    names = list(steps)
    timings = alternate(lambda k: steps[names[k]](), len(names), args.repeats, args.steps, args.warmup, device)
    base = timings.median_ms(0)
    n_params = sum(p.numel() for p in bare.parameters())
    tokens_per_step = args.micro_batch * args.seq
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  dtype=args.dtype, params=n_params, tokens_per_step=tokens_per_step, optimizer=args.optimizer,
                  compile=args.compile,
                  median_ms={n: timings.median_ms(k) for k, n in enumerate(names)},
                  peak_rise_mb={n: timings.peak_rise_bytes[k] / 2**20 for k, n in enumerate(names)})
    print(f"{n_params / 1e6:.1f}M parameters, {args.dtype}{', compiled' if args.compile else ''}, {tokens_per_step} "
          f"tokens per step on {result['device']}; "
          f"{'forward+backward+optimizer' if args.optimizer else 'forward+backward'}, median of "
          f"{args.repeats}x{args.steps} steps")
    flops = num_floating_point_operations(config, args.micro_batch, args.seq)
    result["mfu"] = {n: mfu(flops, t / 1e3, device, 1) for n, t in result["median_ms"].items()}
    print(f"{'variant':36s} {'ms/step':>9s} {'vs bare':>8s} {'tokens/s':>10s} {'MFU':>6s} {'peak rise MB':>13s}")
    for name in names:
        t, utilization = result["median_ms"][name], result["mfu"][name]
        shown = "-" if utilization is None else f"{100 * utilization:.1f}%"
        print(f"{name:36s} {t:9.2f} {100 * (t / base - 1):+7.2f}% {tokens_per_step / t * 1e3:10.0f} {shown:>6s} "
              f"{result['peak_rise_mb'][name]:13.0f}")
    write_json(args.out, result)


def main():
    p = sized_parser(__doc__, SIZES)
    p.add_argument("--bucket-size", type=int, default=None, help="elements per bucket with overlap (default: "
                   "Megatron's, max(40M, 1M x dp))")
    p.add_argument("--optimizer", action="store_true", help="time the optimizer step as well")
    p.add_argument("--compile", action="store_true", help="every variant's model with GPTModel.compile_layers "
                   "(pretrain_gpt.py --torch-compile); the warmup steps compile")
    args, cpu = parse_sized(p, SIZES)
    launch(benchmark, args, 1, cpu=cpu, threads_per_rank=None if cpu else 1)


if __name__ == "__main__":
    main()
