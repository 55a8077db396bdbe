"""One rule for parameter gathers that overlap compute: issue them in a fixed order, dispatch the next one,
wait for mine.

Every rank must issue the same collectives in the same sequence, whatever order its forward (or autograd)
happens to reach the modules in. So gathers are never issued in the order they are needed: needing item i
dispatches every item of the fixed order up to one past i (a prefetch of one), and the caller then waits
for i. An item a rank never needs is still dispatched when the schedule is completed (`dispatch_all`).

Served by the distributed optimizer's deferred all-gather (param_gather.py; items: buckets in forward
order) and by ZeRO-3's units (param_units.py; items: unit indices, one schedule per forward and backward).
"""

from typing import Callable, Hashable, Sequence

PREFETCH = 1
"""Items dispatched past the one needed."""


class PrefetchSchedule:
    """Args:
        order: the items in the one order their gathers are issued in, the same on every rank.
        issue: starts one item's gather (asynchronously); called once per item per round.
    """

    def __init__(self, order: Sequence[Hashable], issue: Callable[[Hashable], None]):
        self.order = list(order)
        self.position = {item: i for i, item in enumerate(self.order)}
        self._issue = issue
        self.next = len(self.order)  # nothing to dispatch until restart()

    def restart(self):
        """A new round: every item is dispatched again, from the first."""
        self.next = 0

    @property
    def pending(self) -> bool:
        """Whether some item of this round has not been dispatched yet."""
        return self.next < len(self.order)

    def dispatch(self, upto: int):
        """Dispatch the items of this round before position `upto` (exclusive) not dispatched yet."""
        while self.next < min(upto, len(self.order)):
            self._issue(self.order[self.next])
            self.next += 1

    def need(self, item: Hashable):
        """`item` is needed now: dispatch up to PREFETCH items past it. The caller then waits for it."""
        self.dispatch(self.position[item] + 1 + PREFETCH)

    def dispatch_all(self):
        """Complete the round: dispatch what this rank did not reach (other ranks may have)."""
        self.dispatch(len(self.order))
