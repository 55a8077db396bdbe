"""Muon's Newton-Schulz work and exchange per rank under the distributed optimizer, counted without processes.

The distributed optimizer gives every Muon matrix, whole, to one position of an instance
(layout.compute_matrix_ownership: LPT by Newton-Schulz cost), and only the owner orthogonalizes it; every rank
of a no_shard run, or of torch DDP + torch.optim.Muon, orthogonalizes every matrix. For a GPT built on the meta
device (no memory, the real parameter list: matrix_specs decides what Muon steps and splits QKV), this script
prints per data-parallel size and position:

  * the multiply-adds of one step's Newton-Schulz, twice: predicted (newton_schulz_cost x steps summed over the
    owned matrices) and counted (torch's FlopCounterMode around muon.orthogonalize of each owned matrix on the
    meta device: the matmuls the code really issues, each Q/K/V block on its own), with the share of the total;
  * what the exchange moves (layout.compute_matrix_exchange over the buffer the model gets, for a few bucket
    sizes): elements sent to other positions, each way, per step; a piece of a matrix the rank owns itself
    stays on the rank.

Results and discussion: docs/distributed_optimizer.md, "Two kinds of ownership"::

    python -m benchmarks.muon_work                         # GPT-2 small and a tiny GQA GPT, dp 1 2 4
    python -m benchmarks.muon_work --model tiny --dp 2 3   # any sizes
"""

import argparse
from typing import Dict, List

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite import OptimizerConfig
from megatron_lite.distributed.layout import (
    DataParallelTopology,
    compute_buffer_layout,
    compute_matrix_exchange,
    compute_matrix_ownership,
)
from megatron_lite.models import GPTConfig, GPTModel
from megatron_lite.optimizer import muon

MODELS: Dict[str, GPTConfig] = {
    # GPT-2 small (124M): 12 layers, h 768, 12 heads, 50257-token vocabulary, 1024 positions
    "gpt2-small": GPTConfig(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
                            max_position_embeddings=1024),
    # the layout docstring's layer: h 64, ffn 256, 4 heads in 2 query groups (Q 64, K 32, V 32 rows)
    "tiny": GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=512,
                      max_position_embeddings=64),
}


def muon_params(config: GPTConfig, optimizer_config: OptimizerConfig):
    """(params in registration order, their MatrixSpec or None) of the GPT, built on the meta device."""
    with torch.device("meta"):
        model = GPTModel(config)
    specs = muon.matrix_specs([model], optimizer_config)
    params = [p for p in model.parameters() if p.requires_grad]
    return params, [specs[p] for p in params]


def counted_multiply_adds(spec: muon.MatrixSpec, optimizer_config: OptimizerConfig) -> int:
    """Multiply-adds of muon.orthogonalize on a whole (meta) matrix of `spec`, as torch's flop counter sees them
    (it counts 2 flops per multiply-add)."""
    with FlopCounterMode(display=False) as counter:
        muon.orthogonalize(torch.empty(spec.rows, spec.cols, device="meta"), spec, optimizer_config)
    return counter.get_total_flops() // 2


def ownership_of(params, specs, dp: int):
    """Whole-matrix ownership over one instance of dp ranks, indexed like `params` (a dense model: one buffer)."""
    return compute_matrix_ownership([s and (s.rows, s.cols) or tuple(p.shape) for p, s in zip(params, specs)],
                                    [s is not None for s in specs], DataParallelTopology(dp),
                                    row_splits=[s and s.row_splits for s in specs])


def exchanges(params, ownership, dp: int, bucket_size):
    """(buckets, per position: (elements it sends to other positions, elements it receives from them)) on the
    way to the owners; the way back swaps the two."""
    layout = compute_buffer_layout([p.numel() for p in params], bucket_size=bucket_size, data_parallel_world_size=dp,
                                   use_distributed_optimizer=True,
                                   shared_embedding=[bool(getattr(p, "shared_embedding", False)) for p in params])
    moved = []
    for position in range(dp):
        exchange = compute_matrix_exchange([layout], ownership, position)
        moved.append((sum(n for q, n in enumerate(exchange.send_splits) if q != position),
                      sum(n for q, n in enumerate(exchange.recv_splits) if q != position)))
    return len(layout.buckets), moved


def work(specs, ownership, dp: int, optimizer_config: OptimizerConfig) -> List[dict]:
    """Per position: the matrices it owns and their Newton-Schulz multiply-adds per step, predicted and counted."""
    counted = {i: counted_multiply_adds(s, optimizer_config) for i, s in enumerate(specs) if s is not None}
    return [dict(matrices=len(ownership.owned(q)), predicted=ownership.load(q) * optimizer_config.muon_num_ns_steps,
                 counted=sum(counted[i] for i in ownership.owned(q))) for q in range(dp)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes (default: 1 2 4)")
    parser.add_argument("--bucket-sizes", type=int, nargs="+", default=[0, 40_000_000, 1_000_000],
                        help="bucket sizes (elements) of the exchange table; 0 is one bucket (default: 0 40000000 "
                             "1000000; 40M is Megatron's default with overlap_grad_reduce up to dp 40)")
    parser.add_argument("--coefficient-type", default="quintic", choices=list(muon.COEFFICIENT_SETS))
    parser.add_argument("--ns-steps", type=int, default=5)
    args = parser.parse_args()
    if min(args.dp) < 1 or min(args.bucket_sizes) < 0:
        parser.error("--dp sizes must be >= 1 and --bucket-sizes >= 0")
    optimizer_config = OptimizerConfig(optimizer="muon", muon_coefficient_type=args.coefficient_type,
                                       muon_num_ns_steps=args.ns_steps)

    built = {name: muon_params(MODELS[name], optimizer_config) for name in args.model}
    for name, (params, specs) in built.items():
        matrix_numel = sum(p.numel() for p, s in zip(params, specs) if s is not None)
        print(f"{name}: {sum(p.numel() for p in params):,} parameters, {sum(s is not None for s in specs)} Muon "
              f"matrices ({matrix_numel:,} elements; a fused QKV is 3 blocks), the rest AdamW")
    print(f"\nNewton-Schulz per step ({args.coefficient_type}, {args.ns_steps} iterations), multiply-adds in G, "
          f"per position of an instance (its ranks orthogonalize only the matrices they own):\n")
    print("| model | dp | position | matrices | predicted | counted | share of the total | 1/dp |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (params, specs) in built.items():
        for dp in args.dp:
            rows = work(specs, ownership_of(params, specs, dp), dp, optimizer_config)
            total = sum(r["counted"] for r in rows)
            for q, r in enumerate(rows):
                print(f"| {name} | {dp} | {q} | {r['matrices']} | {r['predicted'] / 1e9:.3f} | "
                      f"{r['counted'] / 1e9:.3f} | {r['counted'] / total:.3f} | {1 / dp:.3f} |")
            print(f"| {name} | {dp} | busiest / ideal | | | | {max(r['counted'] for r in rows) / (total / dp):.3f} | |")

    print("\nExchange per step, each way (to the owners, and the same elements back; bf16 both ways, 2 bytes each), "
          "in elements as a share of the Muon elements: all positions together, and the busiest position's sends "
          "and receives:\n")
    print("| model | dp | bucket size | buckets | all positions | busiest sends | busiest receives |")
    print("|---|---|---|---|---|---|---|")
    for name, (params, specs) in built.items():
        matrix_numel = sum(p.numel() for p, s in zip(params, specs) if s is not None)
        for dp in [dp for dp in args.dp if dp > 1]:
            ownership = ownership_of(params, specs, dp)
            for bucket_size in args.bucket_sizes:
                buckets, moved = exchanges(params, ownership, dp, bucket_size or None)
                sends, receives = [s for s, _ in moved], [r for _, r in moved]
                print(f"| {name} | {dp} | {bucket_size or 'one bucket'} | {buckets} | "
                      f"{sum(sends) / matrix_numel:.3f} | {max(sends) / matrix_numel:.3f} | "
                      f"{max(receives) / matrix_numel:.3f} |")


if __name__ == "__main__":
    main()
