"""pretrain_gpt.py, except that in the first attempt of a torchrun job rank FAIL_RANK raises in the forward
of iteration FAIL_AT (a rank dying of an exception, for tests/checkpointing/test_last_words.py)."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # run as a script by torchrun: pretrain_gpt.py lives in the repository root
import pretrain_gpt  # noqa: E402
from megatron_lite.training import shutdown  # noqa: E402

_forward_step = pretrain_gpt.forward_step
_calls = [0]


def forward_step(data_iterator, model):
    _calls[0] += 1
    if (os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ["RANK"] == os.environ["FAIL_RANK"]
            and _calls[0] == int(os.environ["FAIL_AT"])):
        raise RuntimeError("injected failure")
    return _forward_step(data_iterator, model)


if __name__ == "__main__":
    pretrain_gpt.forward_step = forward_step
    pretrain_gpt.main()
    shutdown()
