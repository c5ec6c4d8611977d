"""A command's output and end, bounded whatever the command does: what every tier's exec reads."""

import contextlib
import math
import os
import select
import subprocess
import time

KILL_GRACE = 0.3  # after a kill, how long we still wait for the pipes to reach EOF
DISK_TICK_S = 0.02  # how often the disk check's total is looked at


class Capped:
    """The first and last bytes of a stream: memory stays bounded whatever is written."""

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


def drain(proc: subprocess.Popen, deadline: float, cap: int, kill, disk, ended,
          owned=None) -> tuple[int, Capped, Capped, bool]:
    """Read stdout/stderr until EOF or the deadline; at the deadline kill (the tier's way) and give the
    pipes KILL_GRACE to reach EOF. owned: the Sandbox's, so that close() kills the command meanwhile.
    disk: a DiskCheck (over the limit: killed, not timed out; its lines go to stderr). ended() -> (exit
    code, time.monotonic()) of the command itself as its init reported it, or None: a command that ended
    before the deadline did not time out, though killing its leftovers ran late."""
    out, err = Capped(cap), Capped(cap)
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    poller = select.poll()  # not selectors: no epoll instance to make and close per command
    for fd in sinks:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    live, timed_out, killed, give_up = set(sinks), False, False, None

    def stop(now: float) -> None:
        nonlocal killed, give_up
        killed, give_up = True, now + KILL_GRACE
        kill()
        disk.stop()  # after the kill: a command the check froze goes on only to die (a namespaced init must run to kill it)

    def check_disk(now: float) -> float:
        """Kill when the files are over the limit; the time to look again (only reads DiskCheck's total)."""
        if killed:
            return math.inf
        reason = disk.over(now)
        if reason is not None:
            err.add(reason.encode())
            stop(now)
            return math.inf
        return now + DISK_TICK_S

    try:
        if owned is not None:
            owned.track(kill)
        while live:
            now = time.monotonic()
            if not killed and now >= deadline:
                timed_out = True
                stop(now)
            if give_up is not None and now >= give_up:
                break
            next_check = check_disk(now)  # first: a kill here sets give_up
            wake = min(give_up or deadline, next_check)
            for fd, _ in poller.poll(math.ceil(max(0.0, wake - time.monotonic()) * 1000)):
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if data:
                    sinks[fd].add(data)
                else:
                    poller.unregister(fd)
                    live.discard(fd)
        while not killed:  # the pipes are closed; the command may still run (it closed them itself)
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                stop(now)
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, min(deadline, check_disk(now)) - now))
                break
        proc.wait()
        line = disk.finish(deadline)
        if line is not None:
            err.add(line.encode())
    finally:
        disk.stop()  # its thread, whatever ended the drain
        if owned is not None:
            owned.untrack(kill)
        proc.stdout.close()
        proc.stderr.close()
    at = ended() if timed_out else None
    if at is not None and at[1] < deadline:
        return at[0], out, err, False
    # killed at the deadline: -9, whatever status a command that ended at that instant left
    return (-9 if timed_out else proc.returncode), out, err, timed_out
