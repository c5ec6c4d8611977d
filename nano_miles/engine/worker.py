"""The engine thread behind the HTTP server: it owns the Engine and loops step().

Handlers on the event loop never touch the engine; they queue commands (add, abort, pause,
continue, call, update) and await futures the thread resolves with loop.call_soon_threadsafe.
Commands are taken between two steps. Adds are parked while generation is paused or while a weight
update waits for in-flight requests to drain; an update runs once nothing is running (at once while
paused), then the parked adds are admitted.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import traceback

from nano_miles.trainer import heap
from nano_miles.engine.protocol import RequestError


def _resolve(loop, fut, value=None, error=None):
    def apply():
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(value)
    loop.call_soon_threadsafe(apply)


class EngineWorker:
    """Owns the Engine in one thread. Every public method is a command; results come back as futures."""

    def __init__(self, make_engine, loop: asyncio.AbstractEventLoop):
        self.make_engine = make_engine
        self.loop = loop
        self.engine = None
        self.error: str | None = None
        self.loaded = threading.Event()
        self.commands: queue.Queue = queue.Queue()
        self.paused = False
        self.pause_mode = None
        self.parked: list = []     # adds waiting for a continue or for an update to finish
        self.updates: list = []    # calls that need an idle engine (weight swaps), in arrival order
        self.futures: dict = {}    # rid -> future of a request inside the engine
        # rid -> weight version when the request entered the engine. A weight update while paused
        # in place lets a request go on under newer weights: besides the version it finished with
        # (SGLang's weight_version) it reports the version of its OLDEST tokens, which is what the
        # trainer's staleness bound is measured on.
        self.admitted_version: dict = {}
        self.thread = threading.Thread(target=self._main, name="engine", daemon=True)

    # --- commands (called from the event loop) ---
    def _submit(self, *cmd) -> asyncio.Future:
        fut = self.loop.create_future()
        self.commands.put((*cmd, fut))
        return fut

    def add(self, items):
        """One future per item, resolved with (FinishedRequest, weight_version, oldest_weight_version)."""
        futs = [self.loop.create_future() for _ in items]
        self.commands.put(("add", items, futs))
        return futs

    def abort(self, rid: str | None, message: str = "aborted by request"):
        return self._submit("abort", rid, message)

    def pause(self, mode: str):
        return self._submit("pause", mode)

    def resume(self):
        return self._submit("continue")

    def call(self, fn):
        """Run fn(engine) on the engine thread between steps."""
        return self._submit("call", fn)

    def update(self, fn, abort_first: bool):
        """Run fn(engine) once no request is running (or at once while paused)."""
        return self._submit("update", fn, abort_first)

    def stop(self):
        self.commands.put(("stop", None))

    # --- the thread ---
    def _main(self):
        try:
            self.engine = self.make_engine()
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            return
        finally:
            self.loaded.set()
        on_cpu = self.engine.device.type == "cpu"
        worked = False  # since the last trim (heap.py: what glibc keeps after torch frees CPU tensors)
        while True:
            busy = not self.paused and self.engine.has_unfinished()
            idle = not busy and not self._update_ready()
            if idle and worked and on_cpu:
                # going idle (in sync mode: while the trainer updates, when the main job's memory peaks):
                # hand back the heap's free pages that the finished requests left resident
                heap.release_free_heap()
                worked = False
            worked = worked or busy or bool(self.updates)
            try:
                cmd = self.commands.get(block=idle)
                if not self._handle(cmd):
                    return
                while True:  # take every queued command before the next step
                    if not self._handle(self.commands.get_nowait()):
                        return
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
        # Engine.abort_* queue the finished records for the next step(); while paused there is no
        # step, so take them directly.
        done, self.engine.pending = self.engine.pending, []
        return done

    def _deliver(self, finished):
        version = self.engine.weight_version
        for out in finished:
            fut = self.futures.pop(out.rid, None)
            oldest = self.admitted_version.pop(out.rid, version)
            if fut is not None:
                _resolve(self.loop, fut, (out, version, oldest))

    def _admit(self, items, futs):
        eng = self.engine
        busy = set(self.futures) | {it.rid for batch, _ in self.parked for it in batch}
        clash = [it.rid for it in items if it.rid in busy]
        if clash:
            err = RequestError(f"request id(s) {clash} already in flight")
            for f in futs:
                _resolve(self.loop, f, error=err)
            return
        added = []
        try:
            for it, fut in zip(items, futs):
                eng.add_request(it.rid, it.input_ids, it.sampling, return_logprob=it.return_logprob)
                self.futures[it.rid] = fut
                self.admitted_version[it.rid] = eng.weight_version
                added.append(it.rid)
        except (ValueError, AssertionError) as e:  # all or nothing for a batch (KV capacity; asserts: a bug)
            for rid in added:
                eng.abort_request(rid)
                self.futures.pop(rid, None)
                self.admitted_version.pop(rid, None)
            self._take_aborted()
            for f in futs:
                _resolve(self.loop, f, error=RequestError(str(e)))

    def _handle(self, cmd) -> bool:
        kind, *args, fut = cmd
        eng = self.engine
        if kind == "stop":
            return False
        if kind == "add":
            items, futs = args[0], fut
            if self.paused or self.updates:
                self.parked.append((items, futs))
            else:
                self._admit(items, futs)
            return True
        try:
            if kind == "abort":
                rid, message = args
                n = self._abort(rid, message)
                _resolve(self.loop, fut, n)
            elif kind == "pause":
                (mode,) = args
                n = 0
                # abort: running requests finish now (status abort, partial output).
                # retract: their KV is freed and recomputed, with the weights of that moment, once
                #   generation continues; the tokens generated so far are kept.
                # in_place: they keep their KV; if weights change before continue, that KV was
                #   computed with the old weights (SGLang behaves the same).
                if mode == "abort":
                    n = self._abort(None, "aborted by pause_generation")
                elif mode == "retract":
                    for seq in reversed(list(eng.scheduler.running)):
                        eng.scheduler.preempt(seq)
                self.paused, self.pause_mode = True, mode
                _resolve(self.loop, fut, n)
            elif kind == "continue":
                self.paused, self.pause_mode = False, None
                if not self.updates:  # otherwise they wait for the update, which waits for a drain
                    self._admit_parked()
                _resolve(self.loop, fut, True)
            elif kind == "call":
                _resolve(self.loop, fut, args[0](eng))
            elif kind == "update":
                fn, abort_first = args
                if abort_first:
                    self._abort(None, "aborted for a weight update")
                self.updates.append((fn, fut))
        except Exception as e:
            _resolve(self.loop, fut, error=e)
        return True

    def _abort(self, rid, message) -> int:
        n = 0
        if rid is None:
            n += self.engine.abort_all(message)
        elif self.engine.abort_request(rid, message):
            n += 1
        # requests not yet in the engine (parked) finish as aborted too
        keep = []
        for items, futs in self.parked:
            rest = []
            for it, f in zip(items, futs):
                if rid is None or it.rid == rid:
                    version = self.engine.weight_version
                    _resolve(self.loop, f, (_never_started(it, message), version, version))
                    n += 1
                else:
                    rest.append((it, f))
            if rest:
                keep.append(([it for it, _ in rest], [f for _, f in rest]))
        self.parked = keep
        self._deliver(self._take_aborted())
        return n

    def _run_updates(self):
        updates, self.updates = self.updates, []
        for fn, fut in updates:
            try:
                _resolve(self.loop, fut, fn(self.engine))
            except Exception as e:
                _resolve(self.loop, fut, error=e)
        if not self.paused:
            self._admit_parked()

    def _admit_parked(self):
        parked, self.parked = self.parked, []
        for items, futs in parked:
            self._admit(items, futs)


def _never_started(item, message):
    from nano_miles.engine.engine import FinishedRequest

    return FinishedRequest(rid=item.rid, output_ids=[], output_logprobs=[] if item.return_logprob else None,
                           finish_reason={"type": "abort", "message": message},
                           prompt_tokens=len(item.input_ids), completion_tokens=0, cached_tokens=0)
