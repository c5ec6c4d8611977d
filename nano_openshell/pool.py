"""SandboxPool: fresh Sandboxes made and booted ahead of need, so an episode does not wait for one.

A pooled Sandbox IS a fresh one, made earlier: no command ever ran in it, and none is given back.
With none ready, take() makes one the normal way, so it is never slower than no pool.
"""

import collections
import concurrent.futures
import contextlib
import threading
import time
import weakref

from .api import SandboxError
from .sandbox import Sandbox

BOOT_TIMEOUT = 10.0  # a sandbox not booted by then is closed, never pooled


class SandboxPool:
    def __init__(self, size: int, boots: int = 1, **sandbox_kwargs):
        """size: how many booted, unused Sandboxes to keep ready; boots: how many boot at once."""
        for name, value, least in (("size", size, 0), ("boots", boots, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SandboxPool {name} must be an int >= {least}, got {value!r}")
        if sandbox_kwargs.get("workspace") is not None:
            raise ValueError("SandboxPool takes no workspace: each pooled sandbox has a fresh temporary one")
        if sandbox_kwargs.get("mounts"):
            raise ValueError("SandboxPool takes no mounts: sandboxes with mounts are not pooled (take(mounts=...))")
        self.size = size
        self._kwargs = sandbox_kwargs
        self._idle = _Idle()
        self._booting = 0
        self._failing = False  # the last boot raised: refills wait until a take() makes one again
        self._boots = concurrent.futures.ThreadPoolExecutor(boots, thread_name_prefix="nano-openshell-pool")
        self._close_idle = weakref.finalize(self, self._idle.close)  # at close(), collection or exit
        with self._idle.lock:
            self._refill()

    def take(self, mounts: dict[str, str | None] | None = None) -> Sandbox:
        """A fresh Sandbox, booted if one was ready (with mounts: a new one, never pooled); the caller closes it."""
        if mounts:
            return Sandbox(**self._kwargs, mounts=mounts)
        while True:
            with self._idle.lock:
                if self._idle.closed:
                    raise SandboxError("the sandbox pool is closed")
                sb = self._idle.sandboxes.popleft() if self._idle.sandboxes else None
                self._refill()
            if sb is None:
                sb = Sandbox(**self._kwargs)  # the normal way: its init boots while the episode starts
                with self._idle.lock:
                    if self._failing:
                        self._failing = False
                        self._refill()
                return sb
            if sb.wait_ready(0):  # booted, and still alive: it cannot have died unseen while idle
                return sb
            sb.close()

    def idle(self) -> int:
        with self._idle.lock:
            return len(self._idle.sandboxes)

    def wait_filled(self, timeout: float = BOOT_TIMEOUT) -> bool:
        """Wait until `size` sandboxes are ready (False at the timeout, or when refills are failing)."""
        end = time.monotonic() + timeout
        with self._idle.lock:
            while len(self._idle.sandboxes) < self.size:
                left = end - time.monotonic()
                if left <= 0 or self._failing or self._idle.closed:
                    return False
                self._idle.changed.wait(left)
            return True

    def close(self) -> None:
        """Stop refilling, wait for the boots under way, close every sandbox nobody took. Idempotent."""
        with self._idle.lock:
            self._idle.closed = True
        self._boots.shutdown(wait=True, cancel_futures=True)
        self._close_idle()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _refill(self) -> None:  # under the lock
        while not (self._idle.closed or self._failing) and len(self._idle.sandboxes) + self._booting < self.size:
            self._booting += 1
            try:
                self._boots.submit(self._boot)
            except RuntimeError:  # shut down meanwhile (close())
                self._booting -= 1
                return

    def _boot(self) -> None:
        """A new Sandbox, pooled once its init answers. After one that failed, refills wait until a take()
        makes one the normal way (raising what went wrong) rather than fail over and over in the background."""
        sb, ready = None, False
        with contextlib.suppress(Exception):
            sb = Sandbox(**self._kwargs)
            ready = sb.wait_ready(BOOT_TIMEOUT)
        with self._idle.lock:
            self._booting -= 1
            if ready and not self._idle.closed:
                self._idle.sandboxes.append(sb)
                sb = None
            self._failing = self._failing or not ready
            self._idle.changed.notify_all()
        if sb is not None:
            sb.close()


class _Idle:
    """The pool's ready sandboxes, apart from the pool so that a finalizer can close them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.sandboxes: collections.deque[Sandbox] = collections.deque()
        self.closed = False

    def close(self) -> None:
        with self.lock:
            self.closed = True
            sandboxes, self.sandboxes = list(self.sandboxes), collections.deque()
            self.changed.notify_all()
        for sb in sandboxes:
            sb.close()
