"""Live recovery's generations on NCCL (fault_tolerance/membership.py): a generation's process groups formed on
this rank's GPU, interrupted by gen_<g>/abort (the heartbeat thread aborts the NCCL communicators), dropped, and
the next generation formed on the same store with correct collectives; the process survives it with the
TORCH_NCCL_ASYNC_ERROR_HANDLING the agents and the supervisor give it. NCCL at world size 1 (one GPU, one rank),
in a process of its own (a generation replaces the default process group, which cuda_ranks.py's pools keep).
Skipped without a GPU; MLITE_CUDA_TESTS_ON_CPU=1 runs the same steps on gloo/CPU."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from cuda_ranks import ON_CPU, cuda_or_dry_run
from pretrain_testing import REPO

from megatron_lite.fault_tolerance import membership

pytestmark = pytest.mark.skipif(not cuda_or_dry_run(), reason="needs a CUDA device")

HERE = os.path.dirname(os.path.abspath(__file__))
DEADLINE_S = 50.0
"""The whole child (CUDA context, two NCCL generations) ends well within this; a hang fails the test."""


def _generations_on_one_gpu():
    """The child: two generations, the first interrupted through gen_0/abort; reports what it saw."""
    import torch

    member = membership.Membership.from_env()
    backend, device = membership.process_group_backend("gloo" if ON_CPU else None, "cpu" if ON_CPU else None)
    where = device or torch.device("cpu")
    out = {"backend": backend}
    member.join(backend, device)
    dist.new_group([0])  # an instance group beside WORLD: its communicator is aborted too
    total = torch.full((4,), 2.0, device=where)
    dist.all_reduce(total)
    out["gen0_sum"] = total.tolist()
    member.check_reductions()  # nothing was cut short: the update may go ahead
    started = time.monotonic()
    member.store.set("gen_0/abort", "1")  # the leader abandons generation 0
    while member.interrupted != 0 and time.monotonic() - started < 10:
        time.sleep(0.01)
    out["interrupted"], out["interrupt_s"] = member.interrupted, time.monotonic() - started
    try:  # NCCL: no update from this generation's reductions now (partial sums); gloo: nothing to check
        member.check_reductions()
        out["update_refused"] = False
    except membership.Fenced as e:
        out["update_refused"] = not e.slot_lost
    member.leave()
    out["left"] = not dist.is_initialized()
    member.store.set("gen_1/members", "[0]")
    member.store.set("generation", "1")
    member.wait_for_next_generation()
    member.join(backend, device)
    total = torch.full((4,), 3.0, device=where)
    dist.all_reduce(total)
    out["gen1_sum"], out["gen1_device"] = total.tolist(), str(total.device)
    out["gen1_backend"] = dist.get_backend()
    member.store.set("result", json.dumps(out))
    member.leave()
    os._exit(0)


def test_nccl_generation_interrupted_and_formed_again(tmp_path):
    """Would catch: join() forming gloo groups for a CUDA run (NCCL's speed lost, or CUDA tensors through host
    memory), the abort watcher not reaching NCCL (its communicators left to the collective timeout), the
    watchdog tearing the survivor down (TORCH_NCCL_ASYNC_ERROR_HANDLING=1), leave() hanging on an aborted
    communicator, the next generation's groups failing on the same device, or an optimizer update allowed
    after the abort (check_reductions: partial sums) or refused without one."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("generation", "0")
    support = os.path.join(REPO, "tests", "support")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, support, HERE]), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", membership.ENV_STORE: f"127.0.0.1:{store.port}",
           membership.ENV_COLLECTIVE_TIMEOUT: "120", membership.ENV_JOIN_TIMEOUT: "130",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": membership.NCCL_ASYNC_ERROR_HANDLING}
    log = tmp_path / "child.log"
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-c", "import test_cuda_live as t; t._generations_on_one_gpu()"],
                                 env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        child.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        pytest.fail(f"the child did not end within {DEADLINE_S:.0f} s:\n{log.read_text()[-4000:]}")
    assert child.returncode == 0 and store.check(["result"]), log.read_text()[-4000:]
    result = json.loads(store.get("result"))
    expected_backend = "gloo" if ON_CPU else "nccl"
    assert result["backend"] == result["gen1_backend"] == expected_backend, result
    assert result["gen0_sum"] == [2.0] * 4 and result["gen1_sum"] == [3.0] * 4, result
    assert result["interrupted"] == 0 and result["interrupt_s"] < 5, result  # one watcher period: ~0.2 s
    assert result["left"], result
    assert result["update_refused"] == (not ON_CPU), result  # Membership.check_reductions
    assert result["gen1_device"] == ("cpu" if ON_CPU else "cuda:0"), result
    if not ON_CPU:
        assert "NCCL communicators" in log.read_text(), log.read_text()[-4000:]
