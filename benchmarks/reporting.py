"""Shared pieces of the benchmarks' reports: CSV tables and an optional matplotlib."""

import csv
from typing import List, Optional


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a notice) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable (pip install -e '.[bench]'): no plot")
        return None
    return plt


def write_csv(path: str, rows: List[dict], digits: Optional[int] = None):
    """One row per dict, columns in the first row's key order; lists become space-separated values, floats
    are rounded to `digits` decimals when given."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: " ".join("" if x is None else str(x) for x in v).strip() if isinstance(v, list)
                          else round(v, digits) if digits is not None and isinstance(v, float) else v
                          for k, v in r.items()} for r in rows)
