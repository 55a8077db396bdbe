"""Models the wrapper refuses (model_checks.py and its kin), on 2 gloo ranks: one clear error on every rank
instead of a silent wrong result or an obscure failure later -- and ZeRO-3's inner module called directly.

  * refused at wrap time, on every rank: nn.Embedding(sparse=True), Parameters tied through `.data`, float64
    parameters; at the first backward: a custom Function's sparse gradient; the aliasing check itself, without
    processes;
  * ZeRO-3's inner module called directly (`model.module(x)`): refused outside full_parameters(), bit-exact
    with the wrapper inside it, on one rank only too (generation on rank 0);
  * a ZeRO-3 unit returning an object the wrapper cannot look into (refused at its forward);
  * modules replaced after wrapping (refused at the first step).

The models and the builder come from test_third_party_models.py and test_third_party_idioms.py (these tests
were split off the latter).
"""

import pytest
import test_third_party_models as t3
import third_party_models as tpm
import torch
import torch.nn as nn
from distributed_helper import run_distributed
from test_third_party_idioms import DataclassBlock, DataclassStack, build_pair


# ------------------------------------------------------------------------------ refused at wrap time
class SparseEmbeddingLM(nn.Module):
    def __init__(self, vocab=t3.VOCAB, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, sparse=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


class DataTiedLM(nn.Module):
    """Tied by aliasing the data of two Parameters, not by sharing one Parameter."""

    def __init__(self, vocab=t3.VOCAB, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight.data = self.embed.weight.data

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


class SparseGradLookup(torch.autograd.Function):
    """An embedding lookup whose hand-written backward returns a sparse gradient (no module announces it)."""

    @staticmethod
    def forward(ctx, weight, tokens):
        ctx.save_for_backward(tokens)
        ctx.shape = weight.shape
        return weight[tokens]

    @staticmethod
    def backward(ctx, grad):
        (tokens,) = ctx.saved_tensors
        dense = torch.zeros(ctx.shape).index_add_(0, tokens.reshape(-1), grad.reshape(-1, ctx.shape[1]))
        return dense.to_sparse(), None


class SparseFunctionLM(SparseEmbeddingLM):
    def __init__(self):
        super().__init__()
        self.embed.sparse = False  # the module is dense; the Function's gradient is not

    def forward(self, tokens):
        return self.head(SparseGradLookup.apply(self.embed.weight, tokens))


def _refused_worker(strategy):
    errors = []
    for build in (SparseEmbeddingLM, DataTiedLM):
        try:
            t3.build_pair(t3.Case(build, t3.lm_batch, t3.lm_loss, units=()), strategy, True)
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append((type(e).__name__, str(e)))
    try:  # a double-precision model: its optimizer would step it through fp32 main params
        t3.build_pair(t3.Case(lambda: tpm.StackedMLP().double(), t3.regression_batch, t3.mse, units=()), strategy,
                      True)
        errors.append(None)
    except TypeError as e:
        errors.append(str(e))
    ddp, _, _, _ = t3.build_pair(t3.Case(SparseFunctionLM, t3.lm_batch, t3.lm_loss, units=()), strategy, True)
    (tokens,), targets = t3.lm_batch(torch.Generator().manual_seed(0), 0, 0)
    try:
        t3.lm_loss(ddp(tokens), targets).backward()
        errors.append(None)
    except TypeError as e:
        errors.append(str(e))
    return errors


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_unsupported_models_are_refused_on_every_rank(strategy):
    """Would catch nn.Embedding(sparse=True) failing at the first backward with "Cannot access data pointer of
    Tensor that doesn't have storage", and two Parameters tied through `.data` silently untied by the distributed
    optimizer's buffer (ZeRO-1/3: embed and head train apart) while no_shard kept them tied -- instead of one
    error at wrap time, on every rank, naming the module or parameters and the fix; and a custom Function's sparse
    gradient reaching the buffers (the same storage error) instead of a TypeError naming the parameter; and a
    float64 model silently stepped at fp32 precision (its main params are fp32 copies: probed, 5e-8 off torch's
    float64 AdamW after one step) instead of megatron-core's TypeError at get_megatron_optimizer."""
    for errors in run_distributed(_refused_worker, 2, strategy):
        (sparse_type, sparse), (tied_type, tied), float64, from_function = errors
        assert float64 is not None and "stem.weight is torch.float64" in float64 and "fp32" in float64, float64
        assert from_function is not None and "embed.weight received a torch.sparse_coo gradient" in from_function
        assert sparse_type == "TypeError" and "embed" in sparse and "sparse=False" in sparse, sparse
        assert tied_type == "ValueError" and "embed.weight and head.weight" in tied, tied
        assert "head.weight = embed.weight" in tied, tied


def test_overlapping_parameters_found_without_processes():
    """Would catch the aliasing check refusing parameters that are disjoint slices of one storage, a frozen
    pair, or a Parameter shared by two modules (one object: legitimate tying), or missing a partial overlap."""
    from megatron_lite.distributed.model_checks import _overlapping_params

    flat = torch.zeros(20)
    a, b = nn.Parameter(flat[:10]), nn.Parameter(flat[10:])
    assert _overlapping_params([("a", a), ("b", b)]) == []
    c = nn.Parameter(flat[5:15])
    assert _overlapping_params([("a", a), ("b", b), ("c", c)]) == [("a", "c"), ("c", "b")]
    frozen = [nn.Parameter(flat[:10], requires_grad=False), nn.Parameter(flat[:10], requires_grad=False)]
    assert _overlapping_params([("f0", frozen[0]), ("f1", frozen[1])]) == []
    assert _overlapping_params(list(tpm.TiedLM().named_parameters())) == []
    transposed = nn.Parameter(torch.zeros(4, 3).t())  # non-contiguous: its extent still covers 12 elements
    tail = nn.Parameter(transposed.data.t().reshape(-1)[11:])
    assert _overlapping_params([("t", transposed), ("tail", tail)]) == [("t", "tail")]


# ------------------------------------------------------------------------------ ZeRO-3: model.module called
def _zero3_after_one_step():
    """A ZeRO-3 StackedMLP (its stem and head in the root unit) after one training step, its parameters
    released: (case, wrapper, optimizer, generator, the next input)."""
    case = t3.Case(tpm.StackedMLP, t3.regression_batch, t3.mse, units=("ResidualMLP",))
    ddp, opt, _, _ = build_pair(case, "optim_grads_params", True)
    gen = torch.Generator().manual_seed(0)
    t3.megatron_step(ddp, opt, case.loss, [case.batch(gen, 0, 0)])
    (x,), _ = case.batch(gen, 0, 1)
    return case, ddp, opt, gen, x


def _inner_forward_worker():
    _, ddp, _, _, x = _zero3_after_one_step()
    with torch.no_grad():
        through_wrapper = ddp(x)
        with ddp.full_parameters():
            gathered = ddp.module(x)
        try:
            ddp.module(x)
            error = None
        except RuntimeError as e:
            error = str(e)
    return torch.equal(through_wrapper, gathered), error


def test_zero3_inner_module_forward_refuses_placeholders():
    """Would catch `model.module(x)` (evaluation or Hugging Face's generate on the inner model) under ZeRO-3
    silently computing with the released NaN placeholders of the root's parameters (the stem and head here),
    instead of an error on every rank naming the wrapper's forward and full_parameters(); inside
    full_parameters() the inner module must give the wrapper's output bit for bit."""
    for equal, error in run_distributed(_inner_forward_worker, 2):
        assert equal
        assert error is not None and "full_parameters()" in error and "model(...)" in error, error


class Carrier:
    """A plain object holding a block's output (neither a tensor, a container nor a dataclass)."""

    def __init__(self, hidden):
        self.hidden = hidden


class CarrierBlock(DataclassBlock):
    def forward(self, h):
        return Carrier(self.mlp(h))


class CarrierStack(DataclassStack):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([CarrierBlock(10) for _ in range(3)])


def _opaque_output_worker():
    case = t3.Case(CarrierStack, t3.regression_batch, t3.mse)
    ddp, opt, _, _ = build_pair(case, "optim_grads_params", True)
    try:
        t3.megatron_step(ddp, opt, case.loss, [case.batch(torch.Generator().manual_seed(0), 0, 0)])
    except TypeError as e:
        return str(e)
    return None


def test_zero3_unit_output_it_cannot_look_into_is_an_error():
    """Would catch a ZeRO-3 unit returning an object the wrapper cannot find tensors in (no re-gather hook, so its
    backward reads released parameters: "setStorage ... out of bounds for storage of size 0" at the first
    backward) instead of a TypeError at its forward, on every rank, naming the unit, the type and what works."""
    for error in run_distributed(_opaque_output_worker, 2):
        assert error is not None and "CarrierBlock" in error and "Carrier" in error and "dataclass" in error, error


def _rank0_inner_forward_worker():
    """Generation on rank 0 only, inside full_parameters() entered by every rank, then training goes on."""
    import torch.distributed as dist

    case, ddp, opt, gen, x = _zero3_after_one_step()
    with torch.no_grad():
        expected = ddp(x)
        equal = []
        with ddp.full_parameters():
            equal.append(torch.equal(ddp(x), expected))  # the wrapper's forward inside releases nothing either
            if dist.get_rank() == 0:
                equal += [torch.equal(ddp.module(x), expected) for _ in range(3)]  # three decoding steps
    t3.megatron_step(ddp, opt, case.loss, [case.batch(gen, 0, 2)])
    return equal


def test_zero3_inner_module_on_one_rank_inside_full_parameters():
    """Would catch the units' own forward hooks releasing a unit after its forward inside full_parameters(), so
    that rank 0's next forward gathered it again alone: a collective the other ranks never join (gloo's "Received
    data size doesn't match expected size" abort, or a hang) -- for the documented way to generate or evaluate
    on one rank: every rank enters full_parameters(), one runs model.module; and a wrapper forward inside it
    releasing the units, leaving the inner module's next forward on NaN placeholders."""
    results = run_distributed(_rank0_inner_forward_worker, 2)
    assert results == [[True] * 4, [True]], results


# ------------------------------------------------------------------------------ modules replaced after wrapping
def _replaced_worker(config_name):
    """A new task head assigned after wrapping (fine-tuning code that swaps the classifier)."""
    case = t3.Case(tpm.StackedMLP, t3.regression_batch, t3.mse, units=("ResidualMLP",))
    ddp, opt, _, _ = build_pair(case, *t3.CONFIGS[config_name])
    ddp.module.head = nn.Linear(ddp.module.head.in_features, 2)
    before = ddp.module.head.weight.detach().clone()
    gen = torch.Generator().manual_seed(0)
    try:
        t3.megatron_step(ddp, opt, case.loss, [case.batch(gen, 0, 0)])
    except ValueError as e:
        return str(e)
    return f"no error; the new head {'did not train' if torch.equal(before, ddp.module.head.weight) else 'trained'}"


@pytest.mark.parametrize("config", ["no_shard", "optim-overlap", "optim_grads_params"])
def test_module_replaced_after_wrapping_is_an_error(config):
    """Would catch a module assigned after wrapping (a new classifier head) silently never trained (no_shard: its
    parameters are in no buffer and no optimizer, .grad piles up, the old head's zeros are stepped), or refused
    with overlap as "received no gradient" naming the old head and suggesting to freeze it -- instead of one
    error on every rank naming the new and the gone parameters and saying to replace modules before wrapping."""
    for error in run_distributed(_replaced_worker, 2, config):
        assert "head.weight" in error and "before wrapping" in error and "since the model was wrapped" in error, error
