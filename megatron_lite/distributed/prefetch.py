"""One rule for parameter gathers that overlap compute: issue them in a fixed order, dispatch the next ones,
wait for mine.

Every rank must issue the same collectives in the same sequence, whatever order its forward (or autograd)
happens to reach the modules in. So gathers are never issued in the order they are needed: needing item i
dispatches every item of the fixed order up to i and a window past it (the prefetch), and the caller then
waits for i. An item a rank never needs is still dispatched when the schedule is completed (`dispatch_all`).
How far the window reaches changes only when a gather is issued, never which gathers or in which order, so
any window is safe, on one condition: a rank completes the round before it blocks on anything else (another
rank may be waiting for an item this rank has not dispatched yet, and only then reach what this rank waits
for). ZeRO-3 completes its backward round at the start of finish_grad_sync, before the gradient collectives
are waited for: with the window of a round at 0, or shorter than a branch this rank skipped, completing it
later deadlocked.

Served by the distributed optimizer's deferred all-gather (param_gather.py; items: buckets in forward
order) and by ZeRO-3's units (param_units.py; items: unit indices, one schedule per forward and backward).
"""

from typing import Callable, Hashable, Optional, Sequence

PREFETCH = 1
"""Items dispatched past the one needed, by default."""


class PrefetchSchedule:
    """Args:
        order: the items in the one order their gathers are issued in, the same on every rank.
        issue: starts one item's gather (asynchronously); called once per item per round.
        sizes: per item of `order`, its elements (only read with `budget`).
        budget: the window in elements (DeepSpeed's stage3_prefetch_bucket_size): past the item needed,
            items are dispatched while the elements of those already dispatched past it are below this (the
            last one may overshoot); 0: no prefetch. None: PREFETCH items, whatever their size.
    """

    def __init__(self, order: Sequence[Hashable], issue: Callable[[Hashable], None],
                 sizes: Optional[Sequence[int]] = None, budget: Optional[int] = None):
        self.order = list(order)
        self.position = {item: i for i, item in enumerate(self.order)}
        self._issue = issue
        self._sizes = list(sizes) if sizes is not None else None
        self._budget = budget
        if budget is not None and (self._sizes is None or len(self._sizes) != len(self.order)):
            raise ValueError("a prefetch budget needs one size per item")
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

    def window_end(self, position: int) -> int:
        """The position after the last item dispatched when the item at `position` is needed."""
        if self._budget is None:
            return position + 1 + PREFETCH
        end, ahead = position + 1, 0
        while end < len(self.order) and ahead < self._budget:
            ahead += self._sizes[end]
            end += 1
        return end

    def need(self, item: Hashable):
        """`item` is needed now: dispatch it and the window past it. The caller then waits for it."""
        self.dispatch(self.window_end(self.position[item]))

    def dispatch_all(self):
        """Complete the round: dispatch what this rank did not reach (other ranks may have)."""
        self.dispatch(len(self.order))
