"""The context a model call sends is kept and grown, not rebuilt (issue 49 §1), and sends the same bytes.

`Trajectory.context()` keeps one list per segment and its JSON (`backends.base.PromptIds`); the request body
splices that JSON in (`backends.server_client.encode_json`). These check the bytes against a whole encoding, that
a list someone kept is never changed under them, that the kept context follows every way the segment's ids
change, and that the cost of a call at 220k tokens stays near that of a call at 1k (real SGLang client, real
HTTP to the scripted dev server)."""

from __future__ import annotations

import asyncio
import json
import math

import orjson

from backends.base import GenerateRequest, PromptIds
from backends.server_client import encode_json
from fsm.run.trajectory import Trajectory


def _traj(prompt: list[int]) -> Trajectory:
    traj = Trajectory(0, 0, "s", "u", {}, "generating")
    traj.prompt_ids.extend(prompt)
    return traj


def _turn(traj: Trajectory, t: int) -> None:
    traj.append_generated([100 + t, 101 + t], [-0.5, -0.25], 0)
    traj.append_context(list(range(t, t + 7)), "tool")


def test_body_bytes_match_a_whole_encoding_as_the_context_grows():
    ids = PromptIds([1, 2, 3])
    for step in range(5):
        params = {"max_new_tokens": 16, "temperature": 0.7, "stop_token_ids": [2]}
        payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True, "rid": f'r"{step}'}
        plain = {**payload, "input_ids": list(ids)}
        assert encode_json(payload) == orjson.dumps(plain) == encode_json(plain)
        ids.extend(range(step * 1000, step * 1000 + 300))
    # a value orjson writes as null (NaN) takes json.dumps's path for the whole body, as before
    nan = {"input_ids": ids, "sampling_params": {"temperature": math.nan}}
    assert encode_json(nan) == json.dumps({**nan, "input_ids": list(ids)}).encode()
    assert PromptIds().json() == b"" and encode_json({"input_ids": PromptIds()}) == b'{"input_ids":[]}'


def test_context_grows_in_place_and_matches_the_ids():
    traj = _traj([5, 6, 7])
    first = id(traj.context())  # the trajectory holds it, so the id stays its own
    assert traj.context() == [5, 6, 7] and id(traj.context()) == first
    for t in range(3):
        _turn(traj, t)
        assert id(traj.context()) == first  # nobody else holds it: grown, not rebuilt
        assert traj.context() == traj.prompt_ids.tolist() + traj.response_ids.tolist() == traj.context_ids()
        assert bytes(traj.context().json()) == orjson.dumps(traj.context_ids())[1:-1]
    assert id(traj.context_ids()) != first  # context_ids() stays the caller's own list


def test_a_kept_request_never_sees_its_prompt_change():
    """A backend or test that keeps a request past its call keeps the prompt it was sent."""
    traj = _traj([5, 6, 7])
    _turn(traj, 0)
    kept = GenerateRequest("s", traj.context(), {})
    sent = list(kept.prompt_ids)
    sent_json = bytes(encode_json({"input_ids": kept.prompt_ids}))
    _turn(traj, 1)
    now = traj.context()
    assert kept.prompt_ids == sent and now is not kept.prompt_ids
    assert encode_json({"input_ids": kept.prompt_ids}) == sent_json
    assert now == traj.context_ids() and bytes(now.json()) == orjson.dumps(list(now))[1:-1]


def test_a_backend_that_appends_to_its_prompt_does_not_change_the_next_one():
    traj = _traj([5, 6, 7])
    _turn(traj, 0)
    traj.context().extend([999, 998])  # a careless backend's own bookkeeping on request.prompt_ids
    _turn(traj, 1)
    assert traj.context() == traj.prompt_ids.tolist() + traj.response_ids.tolist()


def test_the_kept_context_follows_rewrites_failures_and_prompt_growth():
    traj = _traj([5, 6, 7])
    _turn(traj, 0)
    traj.context()
    traj.prompt_ids.extend([8, 9])  # the gateway's prompt grows in place (fsm/gateway/turn.py)
    assert traj.context() == traj.context_ids() == [5, 6, 7, 8, 9, *traj.response_ids.tolist()]
    traj.messages = [{"role": "assistant", "content": "x"}]
    traj.start_segment([40, 41], "summary", [])
    assert traj.context() == [40, 41]
    _turn(traj, 3)
    traj.context()
    traj.fail("boom")  # the response is cut in place
    _turn(traj, 4)
    _turn(traj, 5)  # longer than before the cut
    assert traj.context() == traj.context_ids() == [40, 41, *traj.response_ids.tolist()]


def test_a_late_call_costs_about_what_an_early_one_does():
    """CPU per call over real HTTP (the SGLang client, the scripted dev server in a subprocess) at 658 and
    220k tokens. Before the kept context the late call cost 4-6x the early one; the bound leaves room for a
    loaded machine."""
    from bench import context as bench  # the bench's server and turn shapes (docs/benchmarks.md)

    async def measure(url: str) -> dict[str, float]:
        from backends.sglang import SGLangBackend

        client = SGLangBackend(url)
        await client.start()
        try:
            return await bench._measure(client, [1, 1000], 5)
        finally:
            await client.close()

    with bench._server() as url:
        times = asyncio.run(measure(url))
    early, late = times.values()
    assert late < 2.0 * early + 0.5, times
