"""Live recovery: a lost rank is replaced while the others keep running (docs/fault_tolerance.md)."""

from .membership import EXIT_FALLBACK, LiveConfig, Membership, live_recovery_enabled

__all__ = ["EXIT_FALLBACK", "LiveConfig", "LiveRecoveryImpossible", "Membership", "live_recovery_enabled",
           "pretrain_live"]


def __getattr__(name: str):
    """The training side on first use only: the launchers (launch.py, agent.py) import this package, and
    loading the training stack (DCP, the checkpoint formats) took a third of an agent's start-up."""
    if name == "pretrain_live":
        from .live_training import pretrain_live
        return pretrain_live
    if name == "LiveRecoveryImpossible":
        from .healing import LiveRecoveryImpossible
        return LiveRecoveryImpossible
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
