"""Live recovery: a lost rank is replaced while the others keep running (docs/fault_tolerance.md)."""

from .healing import LiveRecoveryImpossible
from .live_training import pretrain_live
from .membership import EXIT_FALLBACK, LiveConfig, Membership, live_recovery_enabled

__all__ = ["EXIT_FALLBACK", "LiveConfig", "LiveRecoveryImpossible", "Membership", "live_recovery_enabled",
           "pretrain_live"]
