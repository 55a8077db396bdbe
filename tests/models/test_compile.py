"""GPTModel.compile_layers (pretrain_gpt.py --torch-compile): each layer compiled on its own, so
DistributedDataParallel's hooks stay outside the compiled code. Trained under the wrapper on 2 gloo ranks, it
must follow the eager run and still launch every gradient bucket during backward (overlap kept).
GPTModel.compile_forward (--torch-compile-scope model): the whole forward in one graph; it must follow the eager
run too, its buckets all launching once backward's compute is over, and the command line refuses it under
ZeRO-3. Inductor on the CPU needs a C++ compiler; without one the compiling tests are skipped.
"""

import shutil

import pytest
import torch
from distributed_helper import run_distributed

from megatron_lite.models import GPTConfig, GPTModel
from megatron_lite.training import parse_args

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="torch.compile on the CPU needs a C++ compiler")

LAYER_STRATEGIES = ("no_shard", "optim_grads_params")
MODEL_STRATEGIES = ("no_shard", "optim_grads")  # optim_grads with overlap_param_gather's forward pre-hooks


def _compute_nodes(loss):
    """Every autograd node behind `loss` that computes (all but the parameters' AccumulateGrad)."""
    nodes, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return [node for node in nodes if type(node).__name__ != "AccumulateGrad"]


def _train(strategy, scope, rank, steps=3):
    """Losses and final full parameters of `steps` iterations with `scope` None (eager), 'layers' or 'model'
    compiled, and per backward the number of bucket launches in all, before layer 0's backward began (not
    measured for 'model': layer 0 is inside the graph) and before backward's last compute node finished (the
    first iteration learns the gradient order and launches at the end)."""
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig
    from megatron_lite.distributed import Bucket
    from megatron_lite.optimizer import OptimizerConfig, get_megatron_optimizer

    # Dynamo reuses compiled code across models and does not guard on module hooks: without a reset, a model
    # wrapped with hooks could run code compiled for an earlier model without them.
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=16)
    model = GPTModel(config)
    if scope == "layers":
        model.compile_layers()
    elif scope == "model":
        model.compile_forward()
    distopt = strategy != "no_shard"
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, use_distributed_optimizer=distopt, overlap_grad_reduce=True,
        overlap_param_gather=distopt, bucket_size=2000))
    # SGD: Adam's normalisation would blow a rounding-level gradient difference up to a full step.
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, use_distributed_optimizer=distopt),
                                       [ddp])
    n_buckets = sum(len(buffer.buckets) for buffer in ddp.param_and_grad_buffers)
    launches, original = [], Bucket.start_grad_sync

    def counting_start(bucket, *args):
        launches.append(bucket)
        return original(bucket, *args)

    # Overlap: some bucket must launch before the backward of the first layer has even begun.
    launched_before_layer0 = []
    if scope != "model":
        model.layers[0].register_full_backward_pre_hook(lambda *_: launched_before_layer0.append(len(launches)))

    g = torch.Generator().manual_seed(1)
    losses, launched_in_backward = [], []
    Bucket.start_grad_sync = counting_start
    try:
        for _ in range(steps):
            tokens = torch.randint(0, 64, (2, 2, 16), generator=g)[rank]
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            loss = ddp(tokens, labels=tokens).mean()
            launches.clear()
            # Each compute node records the launches so far when it finishes; the last record is the one
            # taken when backward's compute was over.
            after_compute = []
            for node in _compute_nodes(loss):
                node.register_hook(lambda *_: after_compute.append(len(launches)))
            loss.backward()
            before_layer0 = launched_before_layer0.pop() if launched_before_layer0 else None
            launched_in_backward.append((len(launches), before_layer0, after_compute[-1]))
            ddp.finish_grad_sync()
            optimizer.step()
            losses.append(loss.item())
    finally:
        Bucket.start_grad_sync = original
    full = {k: v.clone() for k, v in ddp.iter_full_state_dict()}
    return dict(losses=losses, params=full, n_buckets=n_buckets, launched_in_backward=launched_in_backward)


def _compile_worker():
    import torch.distributed as dist

    rank = dist.get_rank()
    runs = [(s, scope) for s in LAYER_STRATEGIES for scope in (None, "layers")]
    runs += [(s, scope) for s in MODEL_STRATEGIES for scope in (None, "model") if (s, scope) not in runs]
    return {run: _train(*run, rank) for run in runs}


@pytest.fixture(scope="module")
def compiled_runs():
    return run_distributed(_compile_worker, 2)


def _assert_trains_like_eager(compiled, eager):
    assert eager["n_buckets"] > 2, "the test needs several buckets to show the overlap"
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=1e-5)
    assert compiled["params"].keys() == eager["params"].keys()
    for name, value in eager["params"].items():
        torch.testing.assert_close(compiled["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)


@needs_compiler
def test_compiled_layers_train_like_eager_and_keep_the_overlap(compiled_runs):
    """Would catch compile_layers capturing what the wrapper does around a layer (compiling the whole model
    fails here under ZeRO-3: its graph bakes in a released parameter's storage), compiled layers' gradients
    bypassing main_grad (wrong losses after the first step), or bucket reduces no longer launched while
    backward still has layers to go."""
    for result in compiled_runs:
        for strategy in LAYER_STRATEGIES:
            eager, compiled = result[(strategy, None)], result[(strategy, "layers")]
            _assert_trains_like_eager(compiled, eager)
            # Steady state: every bucket launched inside backward, some before layer 0's backward, in both modes.
            for run in (eager, compiled):
                for in_backward, before_layer0, _ in run["launched_in_backward"][1:]:
                    assert in_backward == run["n_buckets"], (strategy, run["launched_in_backward"])
                    assert 0 < before_layer0 < in_backward, (strategy, run["launched_in_backward"])


@needs_compiler
def test_compiled_forward_trains_like_eager_and_reduces_after_backward(compiled_runs):
    """Would catch compile_forward dropping the wrapper's gradients or its parameter all-gathers (wrong losses
    after the first step: optim_grads waits for the gathers in forward pre-hooks inside the graph), or the
    documented cost changing unnoticed: with the whole forward one graph, backward is one compiled node and no
    bucket can launch before it has finished (the eager run launches some before its last node)."""
    for result in compiled_runs:
        for strategy in MODEL_STRATEGIES:
            eager, compiled = result[(strategy, None)], result[(strategy, "model")]
            _assert_trains_like_eager(compiled, eager)
            for in_backward, _, after_compute in compiled["launched_in_backward"][1:]:
                assert in_backward == compiled["n_buckets"], (strategy, compiled["launched_in_backward"])
            if strategy == "no_shard":  # the gathers' pre-hooks split optim_grads' forward into several graphs
                for _, _, after_compute in compiled["launched_in_backward"][1:]:
                    assert after_compute == 0, compiled["launched_in_backward"]
                for _, _, after_compute in eager["launched_in_backward"][1:]:
                    assert 0 < after_compute, eager["launched_in_backward"]


@pytest.mark.parametrize("method", ["compile_layers", "compile_forward"])
def test_compile_leaves_parameters_and_state_dict_alone(method):
    """Would catch compile_layers or compile_forward replacing modules (state_dict keys with '_orig_mod.') or
    parameters. (Compiling is lazy: nothing is compiled here, so no compiler is needed.)"""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                               max_position_embeddings=16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    assert getattr(model, method)() is model
    assert list(model.parameters()) == params
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def _tiny_gpt():
    torch.manual_seed(0)
    return GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                              max_position_embeddings=16))


@pytest.mark.parametrize("method", ["compile_layers", "compile_forward"])
def test_a_deep_copy_of_a_compiled_model_runs_its_own_parameters(method):
    """Would catch compile_layers or compile_forward storing compiled methods bound to the original: a
    copy.deepcopy of the compiled model (e.g. an EMA or reference copy) kept them and silently computed with
    the original's parameters. (The 'eager' backend: dynamo runs, no compiler needed.)"""
    import copy

    torch._dynamo.reset()
    model = getattr(_tiny_gpt(), method)(backend="eager")
    tokens = torch.randint(0, 64, (1, 16))
    expected = model(tokens).detach()
    duplicate = copy.deepcopy(model)
    # New values everywhere (zeros would not do: the initial biases are zero, so a copy running the original's
    # layers on zero embeddings would still return zeros).
    with torch.no_grad():
        for param in duplicate.parameters():
            param.copy_(torch.randn_like(param))
    reference = _tiny_gpt()  # eager, with the copy's new values
    reference.load_state_dict(duplicate.state_dict())
    torch.testing.assert_close(duplicate(tokens), reference(tokens), msg="the copy ran the original's parameters")
    torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)


def _wrap(model, strategy="optim_grads_params"):
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, use_distributed_optimizer=strategy != "no_shard",
        overlap_grad_reduce=True))


def test_library_refuses_a_whole_forward_graph_under_zero3(single_rank_group):
    """Would catch compile_forward (or torch.compile of the model) accepted under ZeRO-3 outside the command line:
    before wrapping or after it, the first backward failed with autograd's cryptic in-place error (the graph
    keeps parameters the wrapper releases). Refused before anything compiles (torch.compile is lazy: no
    compiler needed), while compile_layers and other strategies are still accepted."""
    tokens = torch.randint(0, 64, (1, 16))
    for build in (lambda: _tiny_gpt().compile_forward(), lambda: torch.compile(_tiny_gpt())):
        with pytest.raises(ValueError, match="compile_forward.*optim_grads_params.*compile_layers"):
            _wrap(build())
    model = _tiny_gpt()
    ddp = _wrap(model)
    model.compile_forward()  # after wrapping: refused at the next forward
    with pytest.raises(ValueError, match="compile_forward.*optim_grads_params.*compile_layers"):
        ddp(tokens, labels=tokens)
    _wrap(_tiny_gpt().compile_layers())
    _wrap(_tiny_gpt().compile_forward(), "optim_grads")


def _flag_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=2)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    return err.strip().splitlines()[-1]


def test_compile_flags_reach_pretrain_and_whole_forward_is_refused_under_zero3(capsys, monkeypatch):
    """Would catch --torch-compile-scope model being accepted under ZeRO-3 (its graph would keep released
    parameters), the refinements silently ignored without --torch-compile, or a flag not reaching
    model_provider (which compiles the scope and mode asked for)."""
    zero3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce"]
    message = _flag_error(["--torch-compile", "--torch-compile-scope", "model"] + zero3, capsys)
    assert "--torch-compile-scope model" in message and "optim_grads_params" in message, message
    for flag, value in (("--torch-compile-scope", "model"), ("--torch-compile-mode", "max-autotune")):
        message = _flag_error([flag, value], capsys)
        assert f"{flag} needs --torch-compile: add --torch-compile, or drop {flag}" in message, message
    for strategy in ("no_shard", "optim", "optim_grads"):
        parse_args(["--torch-compile", "--torch-compile-scope", "model", "--data-parallel-sharding-strategy",
                    strategy], world_size=2)
    parse_args(["--torch-compile"] + zero3, world_size=2)
    for mode in ("default", "max-autotune-no-cudagraphs"):
        parse_args(["--torch-compile", "--torch-compile-mode", mode] + zero3, world_size=2)

    import pretrain_gpt

    calls = []
    for method in ("compile_layers", "compile_forward"):
        monkeypatch.setattr(GPTModel, method, lambda self, _method=method, **options: calls.append(
            (_method, options)) or self)
    for argv in (["--torch-compile"], ["--torch-compile", "--torch-compile-scope", "model",
                                       "--torch-compile-mode", "max-autotune-no-cudagraphs"]):
        args = parse_args(argv, world_size=1)
        args.padded_vocab_size = 64
        pretrain_gpt.model_provider(args)
    assert calls == [("compile_layers", {}), ("compile_forward", {"mode": "max-autotune-no-cudagraphs"})]


def test_cuda_graph_modes_are_refused_under_zero3(capsys):
    """Would catch --torch-compile-mode reduce-overhead or max-autotune (CUDA graphs) accepted with ZeRO-3's
    per-layer compile: the graphs replay the parameter addresses they captured, and ZeRO-3 frees and regrows
    that storage every iteration (wrong values or a crash on the GPU, nothing visible on the CPU)."""
    zero3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce"]
    for mode in ("reduce-overhead", "max-autotune"):
        message = _flag_error(["--torch-compile", "--torch-compile-mode", mode] + zero3, capsys)
        assert f"--torch-compile-mode {mode}" in message, message
        assert "--data-parallel-sharding-strategy optim_grads_params" in message, message
        parse_args(["--torch-compile", "--torch-compile-mode", mode, "--data-parallel-sharding-strategy",
                    "optim_grads", "--use-distributed-optimizer"], world_size=2)
