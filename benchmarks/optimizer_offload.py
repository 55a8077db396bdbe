"""--optimizer-cpu-offload: device memory saved and step time paid, side by side on one rank.

A GPT (GPT-2 125M by default, bf16 params, fp32 grads as pretrain_gpt.py --bf16 sets them, the distributed
optimizer) trained with its optimizer on the device, and offloaded to the host at fractions 1.0 and 0.5
(megatron_lite/optimizer/cpu_offload.py). For each variant:
  * held MB: what the caching allocator holds for the wrapped model and its optimizer after one step
    (torch.cuda.memory_allocated, measured as the variant is built, alone);
  * optimizer state on the device / on the host (MB): the main params and moments, counted by device;
  * ms/step: forward + backward + finish_grad_sync + optimizer step, median over alternating rounds
    (timing.py), and its ratio to the variant without offload.

    python -m benchmarks.optimizer_offload                    # GPT-2 125M on the GPU
    python -m benchmarks.optimizer_offload --device cpu --quick   # a smoke run (nothing to save on a CPU)
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
from megatron_lite.models import GPTConfig, GPTModel

SIZES = dict(layers=(12, 2), hidden=(768, 64), heads=(12, 2), seq=(1024, 32), vocab=(50304, 512), micro_batch=(8, 2),
             repeats=(5, 2), steps=(2, 1), warmup=(1, 1))
"""Flag: (default, default with --quick)."""
VARIANTS = {"on the device": None, "offload 1.0": 1.0, "offload 0.5": 0.5}


def _allocated(device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _state_bytes(opt):
    """(bytes on the device, bytes on the host) of the main params and the optimizer's moments."""
    on_device = on_host = 0
    for shard in opt.sharded_state().shards:
        for tensor in shard.tensors.values():
            if tensor.device.type == "cpu":
                on_host += tensor.numel() * tensor.element_size()
            else:
                on_device += tensor.numel() * tensor.element_size()
    return on_device, on_host


def benchmark(args, rank, world, device):
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       vocab_size=args.vocab, max_position_embeddings=args.seq, params_dtype=dtype)
    tokens = torch.randint(args.vocab, (args.micro_batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    steps, held, state = [], {}, {}
    for name, fraction in VARIANTS.items():
        before = _allocated(device)
        torch.manual_seed(0)
        ddp = DistributedDataParallel(GPTModel(config).to(device), DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True))
        opt = get_megatron_optimizer(OptimizerConfig(
            lr=1e-4, bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=True,
            optimizer_cpu_offload=fraction is not None, optimizer_offload_fraction=fraction or 1.0), [ddp])

        def step(ddp=ddp, opt=opt):
            ddp.zero_grad_buffer()
            ddp(inputs, labels=labels).mean().backward()
            ddp.finish_grad_sync()
            opt.step()

        step()  # the moments exist from the first step on
        held[name] = _allocated(device) - before
        state[name] = _state_bytes(opt)
        steps.append(step)
    names = list(VARIANTS)
    timings = alternate(lambda k: steps[k](), len(names), args.repeats, args.steps, args.warmup, device)
    base = timings.median_ms(0)
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  dtype=args.dtype, cpu_threads=torch.get_num_threads(),
                  params=sum(p.numel() for p in GPTModel(config).parameters()),
                  median_ms={n: timings.median_ms(k) for k, n in enumerate(names)},
                  held_mb={n: held[n] / 2**20 for n in names},
                  state_device_mb={n: state[n][0] / 2**20 for n in names},
                  state_host_mb={n: state[n][1] / 2**20 for n in names})
    print(f"{result['params'] / 1e6:.1f}M parameters, {args.dtype}, distributed optimizer, on {result['device']} "
          f"({result['cpu_threads']} CPU threads); median of {args.repeats}x{args.steps} steps")
    print(f"{'variant':16s} {'held MB':>9s} {'state dev MB':>13s} {'state host MB':>14s} {'ms/step':>9s} "
          f"{'vs device':>10s}")
    for k, name in enumerate(names):
        t = timings.median_ms(k)
        print(f"{name:16s} {result['held_mb'][name]:9.0f} {result['state_device_mb'][name]:13.0f} "
              f"{result['state_host_mb'][name]:14.0f} {t:9.1f} {t / base:9.2f}x")
    write_json(args.out, result)


def main():
    args, cpu = parse_sized(sized_parser(__doc__, SIZES), SIZES)
    launch(benchmark, args, 1, cpu=cpu)  # on the GPU, torch's default threads step the offloaded state

if __name__ == "__main__":
    main()
