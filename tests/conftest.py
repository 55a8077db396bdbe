import datetime
import os
import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def single_rank_group():
    """A world-size-1 gloo process group in the pytest process, for structural (non-collective) tests."""
    with tempfile.TemporaryDirectory(prefix="mlite_single_") as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'rdzv')}", rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
        yield dist.group.WORLD
        dist.destroy_process_group()
