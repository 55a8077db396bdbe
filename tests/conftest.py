import os
import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def single_rank_group():
    """A world-size-1 gloo process group in the pytest process, for structural (non-collective) tests."""
    from megatron_lite.training import initialize_distributed

    with tempfile.TemporaryDirectory(prefix="mlite_single_") as tmp:
        initialize_distributed("gloo", "cpu", 1.0, 0, 1, f"file://{os.path.join(tmp, 'rdzv')}")
        yield dist.group.WORLD
        dist.destroy_process_group()
