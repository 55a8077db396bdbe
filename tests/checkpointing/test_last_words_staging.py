"""Last words written while the record of the next iteration is staged but its optimizer update has not run
(a rank failing inside optimizer.step(), before or during the update): what is written must be the last
completed iteration, and resuming from it must repeat the uninterrupted run bit for bit."""

import contextlib
import os

import pytest
from distributed_helper import run_distributed

STEPS = 5  # iterations 1..5; the failure comes in iteration 3, after 2 completed


def _worker(root, instances):
    """dp = world size, `instances` distributed-optimizer instances. Uninterrupted run vs a run with last
    words (and a periodic checkpoint at iteration 1) that fails in iteration 3's optimizer.step() before the
    update, writes its last words, and is resumed through checkpointing.load_checkpoint in a fresh model
    and optimizer. Then the torn case: a failure inside the update writes nothing."""
    import torch
    import torch.distributed as dist
    from ddp_testing import loss_fn, make_batches
    from optim_testing import STEP_SEED, build, full_state, states_equal

    from megatron_lite import checkpointing
    from megatron_lite.checkpointing import last_words
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, dp = dist.get_rank(), dist.get_world_size()

    def fresh():
        model, ddp, opt = build(dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=40,
                                     num_distributed_optimizer_instances=instances),
                                dict(lr=1e-2, use_distributed_optimizer=True))
        return model, ddp, opt, OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 6, "cosine")

    def backward(ddp, opt, k):
        """Iteration k + 1 up to the update (the training loop's train_step); returns this rank's loss."""
        batches = make_batches(dp, 2, seed=STEP_SEED + k)[rank]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        total = torch.zeros(())
        for i, (x, y) in enumerate(batches):
            with contextlib.nullcontext() if i == len(batches) - 1 else ddp.no_sync():
                loss = loss_fn(ddp, x, y) / len(batches)
                opt.scale_loss(loss).backward()
            total += loss.detach()
        ddp.finish_grad_sync()
        return total

    def iteration(ddp, opt, scheduler, k, words=None):
        """Iteration k + 1 as training/loop.py runs it: stage before the update, commit after it."""
        loss = backward(ddp, opt, k)
        if words is not None:
            words.stage(k + 1, (k + 1) * 8)
        opt.step()
        scheduler.step()
        if words is not None:
            words.commit()
        return loss

    model, ddp, opt, scheduler = fresh()
    straight = [iteration(ddp, opt, scheduler, k) for k in range(STEPS)]
    straight_state = full_state(opt)
    straight_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    # ------------------------------------------------- a failure in iteration 3's step(), before the update
    model, ddp, opt, scheduler = fresh()
    words = last_words.LastWords(root, opt, scheduler, 0, 0)
    iteration(ddp, opt, scheduler, 0, words)
    checkpointing.save_checkpoint(root, 1, ddp, opt, scheduler, 8)  # older than the last words to come
    iteration(ddp, opt, scheduler, 1, words)
    backward(ddp, opt, 2)
    words.stage(3, 24)

    def peer_died():  # step() fails before the update, in a collective with a dead rank (the param gather's wait)
        raise RuntimeError("a peer died (simulated)")
    ddp.finish_param_sync = peer_died
    try:
        opt.step()
    except RuntimeError:
        written = words.write("test: a peer died in optimizer.step()")
    else:
        raise AssertionError("the simulated failure did not happen")
    dist.barrier()

    model, ddp, opt, scheduler = fresh()
    loaded = checkpointing.load_checkpoint(root, ddp, opt, scheduler)
    resumed = [iteration(ddp, opt, scheduler, k) for k in range(loaded["iteration"], STEPS)]
    same_params = all(torch.equal(p, straight_params[n]) for n, p in model.named_parameters())
    result = dict(written=None if written is None else os.path.relpath(written, root),
                  loaded=loaded["iteration"], from_words=bool(loaded.get("last_words")),
                  same_losses=[torch.equal(a, b) for a, b in zip(resumed, straight[loaded["iteration"]:])],
                  same_state=states_equal(full_state(opt), straight_state), same_params=same_params)

    # ------------------------------------------------- torn: a failure inside the update writes nothing
    torn_root = os.path.join(root, "torn")
    model, ddp, opt, scheduler = fresh()
    words = last_words.LastWords(torn_root, opt, scheduler, 0, 0)
    for k in range(2):
        iteration(ddp, opt, scheduler, k, words)
    backward(ddp, opt, 2)
    words.stage(3, 24)

    def update_died(*args, **kwargs):  # inside the update, under update_lock, with optimizer.updating set
        raise RuntimeError("killed inside the update (simulated)")
    opt.optimizer.step = update_died
    try:
        opt.step()
    except RuntimeError:
        result.update(updating=opt.updating, torn=words.write("test: torn update"))
    result.update(torn_files=sorted(os.listdir(torn_root)) if os.path.isdir(torn_root) else [])
    return result


@pytest.mark.parametrize("dp, instances", [(2, 1), (4, 2)], ids=["dp2", "dp4_R2"])
def test_last_words_before_the_update_name_the_previous_iteration(tmp_path, dp, instances):
    """Would catch last words written from the staged record of an iteration whose optimizer update had not
    run (LastWords._current not checking staged['steps_taken'] against optimizer.steps_taken, or stage()
    recording steps_taken without the +1): the set would claim iteration 3 while holding the state after 2,
    and a resume would skip an iteration's data. The set must name iteration 2, win over the older periodic
    checkpoint in load_checkpoint, and the resumed run must repeat the uninterrupted one bitwise (losses,
    optimizer state, parameters). Also a failure inside the update (optimizer.updating still True): a torn
    state is never written."""
    for rank, result in enumerate(run_distributed(_worker, dp, str(tmp_path), instances)):
        assert result["written"] == os.path.join("last_words", "iter_0000002", f"rank_{rank:05d}.pt"), result
        assert result["loaded"] == 2 and result["from_words"], result
        assert result["same_losses"] == [True] * 3, result
        assert result["same_state"] and result["same_params"], result
        assert result["updating"] and result["torn"] is None and result["torn_files"] == [], result
