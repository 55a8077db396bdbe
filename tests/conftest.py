"""Suite-wide setup: the shared helpers in tests/support are importable by plain name from every test folder.

Test folders have no __init__.py, so pytest imports each test module by its file name (`test_sharding`) with
its folder on sys.path; `run_distributed` pickles module-level functions by that name, and spawned workers
inherit sys.path, so they import the same module. Test file names are therefore unique across folders.
"""

import os
import sys
import tempfile

import pytest
import torch.distributed as dist

SUPPORT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, SUPPORT_DIR):  # `benchmarks` as a package from plain `pytest` too; then the helpers
    if _path not in sys.path:
        sys.path.insert(0, _path)


@pytest.fixture(scope="session")
def single_rank_group():
    """A world-size-1 gloo process group in the pytest process, for structural (non-collective) tests."""
    from megatron_lite.training import initialize_distributed

    with tempfile.TemporaryDirectory(prefix="mlite_single_") as tmp:
        initialize_distributed("gloo", "cpu", 1.0, 0, 1, f"file://{os.path.join(tmp, 'rdzv')}")
        yield dist.group.WORLD
        dist.destroy_process_group()
