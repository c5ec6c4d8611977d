"""The engine thread behind the HTTP server: it owns the Engine and loops step().

Handlers on the event loop never touch the engine: they queue commands and await futures the thread
resolves with loop.call_soon_threadsafe. Commands are taken between two steps. Adds are parked while
generation is paused or a weight update waits for in-flight requests to drain; an update runs once
nothing is running (at once while paused), then the parked adds are admitted.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import traceback

from nano_miles.engine.engine import FinishedRequest
from nano_miles.engine.protocol import RequestError
from nano_miles.engine import heap


class EngineWorker:
    """Owns the Engine in one thread. Every public method is a command; results come back as futures."""

    def __init__(self, make_engine, loop: asyncio.AbstractEventLoop):
        self.make_engine, self.loop = make_engine, loop
        self.engine = None
        self.error: str | None = None
        self.loaded = threading.Event()
        self.commands: queue.Queue = queue.Queue()
        self.paused, self.pause_mode = False, None
        self.parked: list = []   # adds ([(item, future)] each) waiting for a continue or an update
        self.updates: list = []  # calls that need an idle engine (weight swaps), in arrival order
        # rid -> (future, weight version when it entered the engine) of a request inside the engine. An
        # update while paused in place lets a request go on under newer weights: it reports the version
        # of its OLDEST tokens too, which the trainer's staleness bound is measured on.
        self.inflight: dict = {}
        self.thread = threading.Thread(target=self._main, name="engine", daemon=True)

    # --- commands (called from the event loop) ---
    def _submit(self, method, *args) -> asyncio.Future:
        fut = self.loop.create_future()
        self.commands.put((method, args, fut))
        return fut

    def add(self, items) -> list:
        """One future per item, resolved with (FinishedRequest, weight_version, oldest_weight_version)."""
        futs = [self.loop.create_future() for _ in items]
        self._submit(self._add, list(zip(items, futs)))
        return futs

    async def run(self, items) -> list:
        """add(items), awaited; a client that goes away (cancelled handler) aborts them. A request the
        engine failed in a step (aborted with status_code 500) raises that status with its reason, as
        SGLang answers a request its scheduler aborted."""
        try:
            results = await asyncio.gather(*self.add(items))
        except asyncio.CancelledError:
            for it in items:
                self.abort(it.rid, "client disconnected")
            raise
        for fin, *_ in results:
            status = fin.finish_reason.get("status_code")
            if fin.finish_reason["type"] == "abort" and isinstance(status, int) and status >= 500:
                failed = RequestError(fin.finish_reason.get("message") or "engine error")
                failed.status = status
                raise failed
        return results

    def abort(self, rid: str | None, message: str = "aborted by request"):
        return self._submit(self._abort, rid, message)

    def pause(self, mode: str):
        return self._submit(self._pause, mode)

    def resume(self):
        return self._submit(self._continue)

    def call(self, fn):
        """Run fn(engine) on the engine thread between steps."""
        return self._submit(lambda: fn(self.engine))

    def update(self, fn, abort_first: bool):
        """Run fn(engine) once no request is running (or at once while paused)."""
        fut = self.loop.create_future()
        self._submit(self._update, fn, abort_first, fut)  # the command's own future: resolved with None
        return fut

    def stop(self):
        self.commands.put((None, (), None))

    # --- the thread ---
    def _resolve(self, fut, value=None, error=None):
        def apply():
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(value)
        self.loop.call_soon_threadsafe(apply)

    def _main(self):
        try:
            self.engine = self.make_engine()
            if self.engine.device.type == "cpu":
                heap.keep_step_buffers()  # the step's temporaries come from the heap (heap.py)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            return
        finally:
            self.loaded.set()
        worked = False  # since the last heap trim
        while True:
            busy = not self.paused and self.engine.has_unfinished()
            idle = not busy and not self._update_ready()
            if idle and worked and self.engine.device.type == "cpu":
                # going idle (in sync mode: while the trainer updates, when the main job's memory
                # peaks): hand back the heap's free pages that the finished requests left resident
                heap.release_free_heap()
                worked = False
            worked = worked or busy or bool(self.updates)
            try:
                cmd = self.commands.get(block=idle)
                while True:  # every queued command before the next step
                    method, args, fut = cmd
                    if method is None:
                        return
                    try:  # _add and _update resolve the futures they were given later
                        self._resolve(fut, method(*args))
                    except Exception as e:
                        self._resolve(fut, error=e)
                    cmd = self.commands.get_nowait()
            except queue.Empty:
                pass
            if self._update_ready():
                self._run_updates()
            if not self.paused and self.engine.has_unfinished():
                try:
                    self._deliver(self.engine.step())
                except Exception as e:  # a bug or OOM in a step must not take the server down
                    traceback.print_exc()
                    self.engine.abort_all(f"engine error: {type(e).__name__}: {e}", status_code=500)
                    self._deliver(self._take_aborted())

    def _update_ready(self) -> bool:
        return bool(self.updates) and (self.paused or not self.engine.has_unfinished())

    def _take_aborted(self):
        # Engine.abort_* queue the finished records for the next step(); while paused there is none.
        done, self.engine.pending = self.engine.pending, []
        return done

    def _deliver(self, finished):
        version = self.engine.weight_version
        for out in finished:
            fut, oldest = self.inflight.pop(out.rid, (None, version))
            if fut is not None:
                self._resolve(fut, (out, version, oldest))

    def _add(self, batch):
        self.parked.append(batch)
        self._admit_parked()

    def _admit(self, batch):
        clash = [it.rid for it, _ in batch if it.rid in self.inflight]  # (nothing is parked while admitting)
        if clash:
            for _, f in batch:
                self._resolve(f, error=RequestError(f"request id(s) {clash} already in flight"))
            return
        eng, added = self.engine, []
        try:
            for it, fut in batch:
                eng.add_request(it.rid, it.input_ids, it.sampling, return_logprob=it.return_logprob)
                self.inflight[it.rid] = fut, eng.weight_version
                added.append(it.rid)
        except (ValueError, AssertionError) as e:  # all or nothing for a batch (KV capacity; asserts: a bug)
            for rid in added:
                eng.abort_request(rid)
                self.inflight.pop(rid, None)
            self._take_aborted()
            for _, f in batch:
                self._resolve(f, error=RequestError(str(e)))

    def _pause(self, mode: str) -> int:
        """abort: running requests finish now (partial output). retract: their KV is freed and
        recomputed, with the weights of that moment, on continue; their tokens are kept. in_place:
        they keep their KV, computed with the old weights if an update comes (as SGLang)."""
        self._deliver(self.engine.drain())  # overlap_schedule: the step in flight, taken in with the weights it ran
        n = self._abort(None, "aborted by pause_generation") if mode == "abort" else 0
        if mode == "retract":
            for seq in reversed(list(self.engine.scheduler.running)):
                self.engine.scheduler.preempt(seq)
        self.paused, self.pause_mode = True, mode
        return n

    def _continue(self) -> bool:
        self.paused, self.pause_mode = False, None
        self._admit_parked()
        return True

    def _update(self, fn, abort_first: bool, fut):
        if abort_first:
            self._abort(None, "aborted for a weight update")
        self.updates.append((fn, fut))

    def _abort(self, rid, message) -> int:
        n = self.engine.abort_all(message) if rid is None else int(self.engine.abort_request(rid, message))
        version, parked, self.parked = self.engine.weight_version, self.parked, []
        for batch in parked:  # requests not yet in the engine finish as aborted too
            rest = []
            for it, f in batch:
                if rid is not None and it.rid != rid:
                    rest.append((it, f))
                    continue
                never_started = FinishedRequest(it.rid, [], [] if it.return_logprob else None,
                                                {"type": "abort", "message": message}, len(it.input_ids), 0, 0)
                self._resolve(f, (never_started, version, version))
                n += 1
            if rest:
                self.parked.append(rest)
        self._deliver(self._take_aborted())
        return n

    def _run_updates(self):
        updates, self.updates = self.updates, []
        for fn, fut in updates:
            try:
                self._resolve(fut, fn(self.engine))
            except Exception as e:
                self._resolve(fut, error=e)
        self._admit_parked()

    def _admit_parked(self):  # unless paused, or an update waits for the running requests to drain
        if not (self.paused or self.updates):
            parked, self.parked = self.parked, []
            for batch in parked:
                self._admit(batch)
