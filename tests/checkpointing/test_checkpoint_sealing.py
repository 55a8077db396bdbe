"""Sealing a checkpoint directory (files.seal_directory: the manifest, the rename into place,
then the tracker) is all or nothing: a save that fails while sealing leaves the previous checkpoint the
newest one by every account (tracker, directory scan, load), in both checkpoint formats."""

import os

import pytest
from distributed_helper import run_distributed


def _worker(root, ckpt_format, fail_at):
    """Save iteration 1, train a step, make the sealing of iteration 2 fail at `fail_at` ('manifest': writing
    manifest.json; 'rename': renaming the temporary directory into place), then look at what is left and
    load it into a fresh model and optimizer."""
    import torch.distributed as dist
    from optim_testing import build, full_state, megatron_steps, states_equal

    from megatron_lite import checkpointing
    from megatron_lite.checkpointing import files
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, dp = dist.get_rank(), dist.get_world_size()

    def fresh():
        _, ddp, opt = build(dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=100),
                            dict(lr=1e-2, use_distributed_optimizer=True))
        return ddp, opt, OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 6, "cosine")

    ddp, opt, scheduler = fresh()
    megatron_steps(ddp, opt, rank, dp, 1)
    scheduler.step()
    checkpointing.save_checkpoint(root, 1, ddp, opt, scheduler, 8, ckpt_format=ckpt_format)
    saved = full_state(opt)
    megatron_steps(ddp, opt, rank, dp, 1, first_step=1)
    scheduler.step()

    final = files.checkpoint_dir(root, 2)
    real_write, real_rename = files.write_atomically, os.rename

    def write_atomically(path, write):
        if fail_at == "manifest" and os.path.basename(path) == files.MANIFEST_FILENAME:
            raise OSError("disk full (simulated, writing the manifest)")
        return real_write(path, write)

    def rename(src, dst, *args, **kwargs):
        if fail_at == "rename" and os.path.abspath(dst) == os.path.abspath(final):
            raise OSError("rename failed (simulated)")
        return real_rename(src, dst, *args, **kwargs)

    files.write_atomically, os.rename = write_atomically, rename
    error = None
    try:
        checkpointing.save_checkpoint(root, 2, ddp, opt, scheduler, 16, ckpt_format=ckpt_format)
    except (OSError, RuntimeError) as e:
        error = str(e)
    finally:
        files.write_atomically, os.rename = real_write, real_rename
    dist.barrier()
    after = dict(error=error, tracker=files.read_tracker(root),
                 complete=sorted(files.complete_checkpoints(root)),
                 latest=files.find_latest(root)[0],
                 listing=sorted(n for n in os.listdir(root) if not n.startswith(".tmp_")))

    ddp, opt, scheduler = fresh()
    loaded = checkpointing.load_checkpoint(root, ddp, opt, scheduler)
    after.update(loaded=loaded["iteration"], same=states_equal(full_state(opt), saved))
    # The failed save blocks nothing: saving iteration 2 again (from the resumed state) succeeds.
    megatron_steps(ddp, opt, rank, dp, 1, first_step=1)
    scheduler.step()
    checkpointing.save_checkpoint(root, 2, ddp, opt, scheduler, 16, ckpt_format=ckpt_format)
    after.update(tracker_then=files.read_tracker(root),
                 complete_then=sorted(files.complete_checkpoints(root)))
    return after


@pytest.mark.parametrize("fail_at", ["manifest", "rename"])
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_failed_sealing_leaves_the_previous_checkpoint_newest(tmp_path, ckpt_format, fail_at):
    """Would catch the tracker (latest_checkpointed_iteration.txt) written before the directory is sealed:
    moved before the manifest (both failure points), or between the manifest and the rename (the rename
    failure). A save that fails there must raise on every rank and leave the tracker naming the previous
    checkpoint, no iter_* directory of the failed save (with or without a manifest), the scan and the load
    at the previous checkpoint (bitwise its optimizer state), and nothing that blocks the next save. 'torch'
    Both formats seal through save._seal -> files.seal_directory."""
    root = str(tmp_path / "ck")
    for result in run_distributed(_worker, 2, root, ckpt_format, fail_at):
        assert result["error"] is not None and "simulated" in result["error"], result
        assert result["tracker"] == 1, f"the tracker names iteration {result['tracker']} after the failed save"
        assert result["complete"] == [1] and result["latest"] == 1, result
        assert result["listing"] == ["iter_0000001", "latest_checkpointed_iteration.txt"], result
        assert result["loaded"] == 1 and result["same"], result
        assert result["tracker_then"] == 2 and result["complete_then"] == [1, 2], result
