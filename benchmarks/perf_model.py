"""An alpha-beta model of a data-parallel step, to choose a bucket size for clusters we cannot run here.

Collectives (Hockney's model as in Thakur, Rabenseifner & Gropp 2005): p ranks, n bytes, latency alpha
(seconds per message step), inverse bandwidth beta (seconds per byte):

    all_reduce      ring  2(p-1) alpha + 2 (p-1)/p n beta      tree  2 ceil(log2 p) alpha + 2 n beta
    reduce_scatter  ring   (p-1) alpha +   (p-1)/p n beta      (all_gather the same)

The step (what DistributedDataParallel with overlap_grad_reduce does): forward F, then backward, during
which parameter k's gradient is ready at time t_k (a timeline recorded on a real run); a bucket can start
when its last gradient is ready; collectives run one at a time in launch order::

    start_b = max(ready_b, end_(b-1)),  end_b = start_b + T(bytes_b)
    step = F + max(B, end_last) + O,    exposed = step - (F + B + O)

with B the end of backward and O the optimizer step. Buckets come from the real layout function
(megatron_lite.distributed.layout), so a prediction uses exactly the buckets DDP would build.

How much communication really hides behind backward depends on the hardware: on GPUs NCCL runs on its own
stream beside the compute kernels (overlap = 1: the timeline above); on a CPU whose cores all compute,
gloo's collectives take cycles from backward and hide nothing (overlap = 0: exposed = the sum of the
collectives). `overlap` (in [0, 1]) blends the two and is fitted on measured steps (fit_overlap).
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from megatron_lite.distributed.layout import compute_buffer_layout

COEFFICIENTS = {  # (latency steps, bandwidth multiple of n) per collective and algorithm, as functions of p
    ("all_reduce", "ring"): lambda p: (2 * (p - 1), 2 * (p - 1) / p),
    ("all_reduce", "tree"): lambda p: (2 * math.ceil(math.log2(p)), 2.0),
    ("reduce_scatter", "ring"): lambda p: (p - 1, (p - 1) / p),
    ("all_gather", "ring"): lambda p: (p - 1, (p - 1) / p),
}


@dataclass(frozen=True)
class Link:
    """alpha: seconds of latency per message step; beta: seconds per byte (1 / bandwidth)."""
    alpha: float
    beta: float

    @classmethod
    def from_network(cls, latency_us: float, bandwidth_gbps: float) -> "Link":
        return cls(latency_us * 1e-6, 8.0 / (bandwidth_gbps * 1e9))


def collective_time(kind: str, nbytes: float, p: int, link: Link, algorithm: str = "ring") -> float:
    """Seconds for one collective of `nbytes` (the full buffer) over `p` ranks; 0 for one rank."""
    if p == 1:
        return 0.0
    if (kind, algorithm) not in COEFFICIENTS:
        raise ValueError(f"no model for {kind} with algorithm {algorithm!r}: {sorted(COEFFICIENTS)}")
    steps, multiple = COEFFICIENTS[kind, algorithm](p)
    return steps * link.alpha + multiple * nbytes * link.beta


def fit_link(samples: Sequence[Tuple[str, float, int, float]], algorithm: str = "ring") -> Link:
    """Least-squares alpha, beta (both >= 0) from measured (kind, nbytes, p, seconds) samples."""
    rows = []
    for kind, nbytes, p, seconds in samples:
        steps, multiple = COEFFICIENTS[kind, algorithm](p)
        rows.append((steps, multiple * nbytes, seconds))
    saa = sum(a * a for a, _, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    say = sum(a * y for a, _, y in rows)
    sby = sum(b * y for _, b, y in rows)
    det = saa * sbb - sab * sab
    alpha, beta = ((sbb * say - sab * sby) / det, (saa * sby - sab * say) / det) if det else (0.0, sby / sbb)
    if alpha < 0:  # latency not resolved by the samples: bandwidth only
        alpha, beta = 0.0, sby / sbb
    if beta < 0:
        alpha, beta = say / saa, 0.0
    return Link(alpha, beta)


@dataclass
class Timeline:
    """A recorded step: forward F, backward ends at B (from its start), optimizer O, all in seconds; per
    parameter in registration order its numel and when its gradient was ready (seconds into backward)."""
    forward: float
    backward: float
    optimizer: float
    numels: List[int]
    ready: List[float]
    bytes_per_element: int = 4

    def scaled(self, factor: float) -> "Timeline":
        """The same step with compute `factor` times slower (e.g. more ranks than cores)."""
        return Timeline(self.forward * factor, self.backward * factor, self.optimizer * factor, self.numels,
                        [t * factor for t in self.ready], self.bytes_per_element)


def buckets(timeline: Timeline, bucket_size: int, dp: int,
            distributed_optimizer: bool = False) -> List[Tuple[float, int]]:
    """(ready time, bytes) of every bucket DDP would build, in launch order."""
    layout = compute_buffer_layout(timeline.numels, bucket_size=bucket_size, data_parallel_world_size=dp,
                                   use_distributed_optimizer=distributed_optimizer)
    out = [(max(timeline.ready[i] for i in b.param_indices), (b.end - b.start) * timeline.bytes_per_element)
           for b in layout.buckets]
    return sorted(out)


def predict(timeline: Timeline, bucket_size: int, dp: int, link: Link, algorithm: str = "ring",
            distributed_optimizer: bool = False, overlap: float = 1.0) -> Dict[str, float]:
    """Predicted step, exposed communication and bucket count for one bucket size (seconds)."""
    end = total = 0.0
    kind = "reduce_scatter" if distributed_optimizer else "all_reduce"
    plan = buckets(timeline, bucket_size, dp, distributed_optimizer)
    for ready, nbytes in plan:
        seconds = collective_time(kind, nbytes, dp, link, algorithm)
        end, total = max(ready, end) + seconds, total + seconds
    exposed = overlap * (max(timeline.backward, end) - timeline.backward) + (1 - overlap) * total
    if distributed_optimizer:  # the parameter all-gather after the step (not overlapped here)
        exposed += sum(collective_time("all_gather", nbytes, dp, link) for _, nbytes in plan)
    compute = timeline.forward + timeline.backward + timeline.optimizer
    return {"step": compute + exposed, "exposed": exposed, "buckets": len(plan)}


def fit_overlap(timeline: Timeline, link: Link, measured: Dict[int, float], dp: int, algorithm: str = "ring",
                distributed_optimizer: bool = False) -> float:
    """The overlap in [0, 1] (steps of 0.05) whose predictions best match measured {bucket size: seconds}."""
    def error(overlap):
        return sum((predict(timeline, b, dp, link, algorithm, distributed_optimizer, overlap)["step"] - t) ** 2
                   for b, t in measured.items())
    return min((k / 20 for k in range(21)), key=error)


def recommend(timeline: Timeline, sizes: Sequence[int], dp: int, link: Link, algorithm: str = "ring",
              tolerance: float = 0.02, distributed_optimizer: bool = False,
              overlap: float = 1.0) -> Tuple[int, Dict[int, dict]]:
    """The bucket size with the smallest predicted step (ties within `tolerance`: the larger bucket, fewer
    collectives) and every size's prediction."""
    table = {s: predict(timeline, s, dp, link, algorithm, distributed_optimizer, overlap) for s in sizes}
    best = min(v["step"] for v in table.values())
    return max(s for s, v in table.items() if v["step"] <= best * (1 + tolerance)), table
