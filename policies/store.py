"""``PolicyStore``: holds the active PolicySet and swaps in a staged one only at a transition boundary.

Pure bookkeeping (no asyncio, no I/O), so a policy never changes in the middle of a transition.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .document import default_policies
from .policy_set import PolicySet

__all__ = ["PolicyStore"]


class PolicyStore:
    """The active PolicySet plus at most one pending swap.

    ``stage(new)`` validates nothing (a PolicySet is already valid) and takes effect only when the
    daemon calls ``at_boundary()`` between transitions::

        store.stage(load_policy_yaml(body))      # PUT /v1/policies, SIGHUP
        ...
        store.at_boundary()                      # daemon, before starting the next transition
    """

    def __init__(self, initial: PolicySet | None = None) -> None:
        # A lock, not asyncio: SIGHUP or a file watcher may stage from another thread.
        self._lock = threading.Lock()
        self._active = (initial or default_policies()).with_version(1)
        self._pending: PolicySet | None = None
        self._next_version = 2
        self._in_transition = False

    @property
    def active(self) -> PolicySet:
        """The PolicySet every decision of the current transition uses."""
        return self._active

    @property
    def pending(self) -> PolicySet | None:
        """The staged PolicySet waiting for the next boundary, if any."""
        return self._pending

    def stage(self, new: PolicySet) -> PolicySet:
        """Record ``new`` for the next boundary and return it with its version.

        A later stage replaces an earlier pending one (last write wins; versions still only grow).
        Staging policies equal to what is already active (same fingerprint) drops any pending swap
        and returns the active set unchanged, so re-applying the same file is a no-op.
        """
        with self._lock:
            if new.fingerprint == self._active.fingerprint:
                self._pending = None
                return self._active
            if self._pending is not None and new.fingerprint == self._pending.fingerprint:
                return self._pending
            self._pending = new.with_version(self._next_version)
            self._next_version += 1
            return self._pending

    def discard(self) -> PolicySet | None:
        """Drop the pending swap; return what was dropped."""
        with self._lock:
            dropped, self._pending = self._pending, None
            return dropped

    def at_boundary(self) -> PolicySet | None:
        """Swap in the pending PolicySet, if any; return it (None when nothing was pending).

        Raises RuntimeError inside ``transition()``: a swap there would land mid-transition.
        """
        with self._lock:
            if self._in_transition:
                raise RuntimeError("policy swap requested while a transition is in progress")
            return self._swap_locked()

    @contextmanager
    def transition(self) -> Iterator[PolicySet]:
        """Apply any pending swap, then pin the active set for the body (one transition)::

        with store.transition() as policies:
            directive = policies.process_groups.before_pause(snapshot)
        """
        with self._lock:
            if self._in_transition:
                raise RuntimeError("transitions do not nest")
            self._swap_locked()
            self._in_transition = True
            pinned = self._active
        try:
            yield pinned
        finally:
            with self._lock:
                self._in_transition = False

    def _swap_locked(self) -> PolicySet | None:
        if self._pending is None:
            return None
        self._active, self._pending = self._pending, None
        return self._active
