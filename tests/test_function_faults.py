"""A generate function that raises a BaseException (KeyboardInterrupt, SystemExit, its own CancelledError) ends
its own rows with an error naming it; the engine's thread, the other rows, generate_sequences and close go on.

Through the synchronous RolloutEngine (its event loop runs in a thread of its own), each call bounded: before,
the BaseException escaped the loop, killed that thread, and generate_sequences and close waited forever.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from backends.function import FunctionBackend
from fsm import RolloutEngine
from tests.conftest import ASSETS
from tests.test_integration import calc_script, question

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def bounded(fn, timeout_s: float = 60.0):
    """fn() in a daemon thread; its result, or a test failure if it is still running after timeout_s."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (reported to the test below)
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still running after {timeout_s} s: the engine hangs"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, asyncio.CancelledError, GeneratorExit])
def test_a_base_exception_from_the_function_ends_its_rows_never_the_engine(tok, exc):
    script = calc_script(tok)
    turns: dict[int, int] = {}

    async def generate(prompt_ids: list[int], sampling_params: dict) -> dict:
        if "7 * 6" in tok.decode(prompt_ids):
            raise exc("from inside the function")
        row = 0
        turns[row] = turns.get(row, 0) + 1
        return {"token_ids": script(row, 0, turns[row] - 1, prompt_ids)}

    rows = [question(), question("What is 7 * 6?", "42")]
    engine = RolloutEngine(
        "calculator", tokenizer=ASSETS, backend=FunctionBackend(generate, model_name="eng")
    )
    try:
        out = bounded(lambda: engine.generate_sequences(rows))
        reasons = list(out.non_tensor_batch["termination_reason"])
        assert reasons[0] == "done", reasons
        assert (
            reasons[1].startswith("error: backend: ")
            and f"eng: generate function raised {exc.__name__}" in reasons[1]
        )
        again = bounded(lambda: engine.generate_sequences(rows[:1]))  # the engine's thread is alive
        assert list(again.non_tensor_batch["termination_reason"]) == ["done"]
    finally:
        bounded(engine.close)
