"""The proxy's audit log: one JSONL line per decision, bounded on disk whatever a sandbox sends.

- every string field is cut to FIELD_CHARS (a denied request can carry an 8 KiB path or host);
- at max_bytes the file rotates (audit.jsonl -> audit.jsonl.1, one old file kept): at most about
  twice max_bytes on disk;
- requests refused by the rate limit are counted, not logged one by one: one summary record
  {"decision": "deny", "status": 429, "count": N, "reason": "N more requests refused: rate limit"}
  goes out at most once a second while they keep coming, and at close().
"""

import json
import os
import threading
import time

FIELD_CHARS = 256
SUMMARY_EVERY = 1.0  # seconds between two summaries of rate-limited requests


def _cut(value):
    if isinstance(value, str) and len(value) > FIELD_CHARS:
        return value[:FIELD_CHARS] + f"...[{len(value) - FIELD_CHARS} more chars]"
    return value


class AuditLog:
    def __init__(self, path: str, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self._lock = threading.Lock()
        self._size = os.path.getsize(path) if os.path.exists(path) else 0
        self._refused, self._refused_since, self._last_summary = 0, 0.0, 0.0

    def write(self, record: dict) -> None:
        """Log one decision (the timestamp is added here)."""
        with self._lock:
            self._flush_refused()
            self._append({"ts": round(time.time(), 6), **{k: _cut(v) for k, v in record.items()}})

    def refused(self) -> None:
        """Count one request refused by the rate limit; summarise them at most once a second."""
        with self._lock:
            if not self._refused:
                self._refused_since = time.time()
            self._refused += 1
            if time.monotonic() - self._last_summary >= SUMMARY_EVERY:
                self._flush_refused()

    def close(self) -> None:
        with self._lock:
            self._flush_refused()

    def _flush_refused(self) -> None:
        if not self._refused:
            return
        self._append({"ts": round(time.time(), 6), "since": round(self._refused_since, 6),
                      "decision": "deny", "status": 429, "count": self._refused,
                      "reason": f"{self._refused} more requests refused: rate limit"})
        self._refused, self._last_summary = 0, time.monotonic()

    def _append(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()
        if self._size and self._size + len(line) > self.max_bytes:
            os.replace(self.path, self.path + ".1")
            self._size = 0
        with open(self.path, "ab") as f:
            f.write(line)
        self._size += len(line)
