"""A process's peak resident memory per phase, from Linux's own counters (torch's CPU allocator keeps no
statistics): /proc/self/status's VmHWM is the high-water mark of VmRSS, and writing 5 to
/proc/self/clear_refs resets it to the current RSS, so the peak of a phase is read without sampling.

    baseline = rss()                  # before the model exists
    with phase() as peak:
        build()
    print(peak.bytes - baseline)      # the phase's peak, above the baseline

What is counted is the whole process (every tensor, allocator slack, library buffers): an upper bound on
the tensors' bytes, not an estimate of them.
"""

import contextlib
import gc


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def rss() -> int:
    """Resident bytes now."""
    return _status("VmRSS")


def available() -> bool:
    """Whether the peak can be reset (Linux >= 4.0 with a writable /proc/self/clear_refs)."""
    try:
        _reset()
        return True
    except OSError:
        return False


def _reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _Peak:
    bytes = 0


@contextlib.contextmanager
def phase():
    """Yield a record whose `.bytes` is, after the block, the peak RSS reached inside it."""
    gc.collect()
    _reset()
    record = _Peak()
    try:
        yield record
    finally:
        record.bytes = _status("VmHWM")
