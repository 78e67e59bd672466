"""The process's heap frozen while engines run, so the cyclic collector scans only what runs make.

With many trajectories in flight, Python runs full (generation 2) collections during a batch, and each walks every
object of the process (torch's, transformers', the trainer's): a large share of the client's CPU per model call
(docs/benchmarks.md, "The client under load"). `gc.freeze()` after a full collection moves what exists then out of
the collector's sight, as vLLM's and SGLang's servers do; cycles among the frozen objects wait for the last engine's
close, which unfreezes (an engine dropped unclosed holds it as long as the process). An engine freezes when a run
first puts FREEZE_AT trajectories in flight: below that the collection before the freeze costs more than it saves.
While frozen, the collector runs at RUN_THRESHOLD: a batch's short-lived objects are nearly none in cycles (a
tool call's timeout and a retried failure once were: tests/test_heap.py, tests/test_server_faults.py), so they die
by their reference counts and a steady run of batches needs no young collection at all, while each one would walk
every young object, prompts' ids included.

A process that froze its heap itself (`gc.get_freeze_count()` not 0 when the first engine would freeze) is left to
manage it: no freeze, no unfreeze. `RolloutEngine(freeze_heap=False)` opts an engine out. A Ray actor
(fsm/adapters/ray_runner.py) freezes its own process the same way, for a chunk of FREEZE_AT trajectories.
"""

from __future__ import annotations

import gc
import threading

FREEZE_AT = 256  # trajectories in flight (with those joining) that make an engine freeze the heap
RUN_THRESHOLD = (200000, 20, 20)  # gc.set_threshold while frozen (docs/benchmarks.md, the twelfth pass)
_lock = threading.Lock()
_holders = 0  # engines started and not closed, holding the freeze
_before: tuple[int, int, int] = (700, 10, 10)  # the thresholds the freeze replaced


class Held:
    """One engine's hold on the freeze: `release()` once, at its close (a second call does nothing)."""

    def __init__(self) -> None:
        self._released = False

    def release(self) -> None:
        global _holders
        with _lock:
            if self._released:
                return
            self._released = True
            _holders -= 1
            if _holders == 0:
                gc.unfreeze()
                gc.set_threshold(*_before)


def hold() -> Held | None:
    """Freeze the heap as it is (after a full collection: no garbage is frozen) unless it is frozen already by
    another engine, which this one then shares, or by the process itself (None: nothing held)."""
    global _holders, _before
    with _lock:
        if _holders:
            _holders += 1
            return Held()
    # Outside the lock: the finalizers the collection runs may release another engine's hold.
    gc.collect()
    with _lock:
        if not _holders:
            if gc.get_freeze_count():
                return None
            gc.freeze()
            _before = gc.get_threshold()
            gc.set_threshold(*RUN_THRESHOLD)
        _holders += 1
        return Held()
