"""A command's output and end, bounded: what every tier's exec reads, whatever the command does.

drain() reads stdout and stderr until both reach EOF or the deadline comes; at the deadline it kills
(the tier's own way), gives the pipes KILL_GRACE to reach EOF (they do once the tree is dead) and
stops reading regardless. Capped keeps the first and last bytes of a stream, so memory stays bounded
however much is written.
"""

import math
import os
import select
import subprocess
import time

KILL_GRACE = 0.3  # after a kill, how long we still wait for the pipes to reach EOF


class Capped:
    """Keeps the first and last bytes of a stream; memory stays bounded whatever is written."""

    def __init__(self, cap: int):
        self.head_cap, self.tail_cap = cap // 2, cap - cap // 2
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data[-self.tail_cap:]
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[:-self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_cap + self.tail_cap

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_cap:])
        if not self.truncated:
            return (bytes(self.head) + tail).decode("utf-8", errors="replace")
        dropped = self.total - len(self.head) - len(tail)
        return (bytes(self.head).decode("utf-8", errors="replace")
                + f"\n[... nano-openshell: {dropped} bytes truncated ...]\n"
                + tail.decode("utf-8", errors="replace"))


def drain(proc: subprocess.Popen, deadline: float, cap: int, kill, owned=None) -> tuple[int, Capped, Capped, bool]:
    """Read stdout/stderr until EOF or the deadline; at the deadline kill, then give the pipes a short
    grace to reach EOF (they do once the tree is dead) and stop reading regardless. owned: the
    Sandbox's (track/untrack), so that close() kills the command meanwhile."""
    out, err = Capped(cap), Capped(cap)
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    poller = select.poll()  # not selectors: no epoll instance to make and close per command
    for fd in sinks:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    live, timed_out, give_up = set(sinks), False, None
    try:
        if owned is not None:
            owned.track(kill)
        while live:
            now = time.monotonic()
            if not timed_out and now >= deadline:
                timed_out, give_up = True, now + KILL_GRACE
                kill()
            if give_up is not None and now >= give_up:
                break
            for fd, _ in poller.poll(math.ceil(max(0.0, (give_up or deadline) - now) * 1000)):
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if data:
                    sinks[fd].add(data)
                else:
                    poller.unregister(fd)
                    live.discard(fd)
        if not timed_out:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                kill()
        proc.wait()
    finally:
        if owned is not None:
            owned.untrack(kill)
        proc.stdout.close()
        proc.stderr.close()
    return proc.returncode, out, err, timed_out
