"""The built-in actions: the work each standard state does. The driver awaits them; guards then decide.

`encode_prompt` (PENDING), `generate` (GENERATING), `call_tools` (PROCESSING_TOOLS), `interact`
(INTERACTING); `BUILTIN_ACTIONS` is the table the compiler reads. A user action has the same signature,
`async def action(ctx, traj)`, and uses the same helpers (`ctx.call_backend`, `ctx.add_observation`), so it
inherits the token rules for free.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

from backends.base import BackendTimeout, GenerateRequest, GenerateResult, GenerationAborted
from fsm.data.rows import RowError, encodable, prompt_messages, score_fault
from fsm.families.codec import UnknownRole
from fsm.families.pieces import extend_array
from fsm.run.context import RunContext
from fsm.run.failures import StateFailure
from fsm.run.policy import sync_template
from fsm.run.trajectory import Trajectory, first_segment
from fsm.run.tree import RUN_NODE_BOUND, run_child


async def encode_prompt(ctx: RunContext, traj: Trajectory) -> None:
    traj.messages = prompt_messages(traj.row, f"bad row {traj.row_name}")
    # Samples of a group share one encoding. The uid comes from the row, so a reused uid must not hand
    # one row's prompt to another: a hit also needs the same messages and tool schemas.
    group = ctx.group_size
    if group == 1:  # nobody shares it: nothing kept
        ids = _render_prompt(ctx, traj)
    else:
        key = (traj.messages, traj.tool_schemas)
        entry = ctx.prompt_cache.get(traj.uid)
        if entry is None or entry[0] != key:
            entry = ctx.prompt_cache[traj.uid] = [key, array("i", _render_prompt(ctx, traj)), 0]
        ids = entry[1]
        entry[2] += 1
        if group is not None and entry[2] >= group:  # the group's last sample: no one else needs it
            del ctx.prompt_cache[traj.uid]
    limit = ctx.agent.limits.prompt_length
    if len(ids) > limit:
        if ctx.agent.limits.prompt_overflow == "error":
            raise RowError(f"prompt_too_long: {len(ids)} tokens > prompt_length {limit}", "prompt_too_long")
        ids = ids[-limit:]
        traj.extra["prompt_truncated"] = True
    extend_array(traj.prompt_ids, ids)  # the encoder's array copied whole, not each id of its list converted
    # the first segment's prompt renders these messages
    traj.segment_start = first_segment(len(traj.messages))


def _render_prompt(ctx: RunContext, traj: Trajectory) -> list[int]:
    """The prompt's ids; a chat template that cannot render the row's messages is that row's error, naming
    the row and the message whose content is not plain text (the usual cause: content parts or numbers)."""
    try:
        return ctx.codec.encode_prompt(traj.messages, traj.tool_schemas)
    except RowError:
        raise
    except UnknownRole as exc:  # the message would vanish from the prompt without a word
        raise RowError(f"bad row {traj.row_name}: 'raw_prompt[{exc.index}].role': {exc}", "bad_row") from None
    except Exception as exc:
        odd = next(
            (
                f"; 'raw_prompt[{k}].content' is a {type(m.get('content')).__name__}, not text"
                for k, m in enumerate(traj.messages)
                if not isinstance(m.get("content"), (str, type(None)))
            ),
            "",
        )
        raise RowError(
            f"bad row {traj.row_name}: the chat template cannot render 'raw_prompt': {type(exc).__name__}: "
            f"{exc}{odd}",
            "bad_row",
        ) from None


async def generate(ctx: RunContext, traj: Trajectory) -> None:
    """One model turn: request the continuation of the whole context, append it, parse tool calls. Under the
    `template` context policy the context is first the template's render of the conversation (a new segment
    when it does not extend the current one's tokens).

    The turn runs under `limits.turn_timeout_s` (retries, failovers and resumes included, and a state's retries
    of the turn: they run within its first attempt's deadline, so they never re-open the router's retry window
    past it). A turn the server aborts is resumed rather than taken as output (`_resumed_turn`).
    """
    limits = ctx.agent.limits
    if ctx.agent.spec.context.policy == "template" and not sync_template(ctx, traj):  # fsm/run/policy.py
        return  # the render does not fit in prompt_length: the budget counts as spent
    budget = limits.response_length - len(traj.response_mask)
    if budget <= 0 or ctx.sampling.max_new_tokens == 0:
        traj.last_finish_reason = "length"
        return
    params = ctx.sampling.for_turn(traj, budget)
    rid = f"{traj.session_id}_t{traj.assistant_turns:02d}"
    t0 = time.perf_counter()
    at, key = traj.turn_deadline, (rid, len(traj.path))  # a state's retry of this turn: the same key
    if at is None or at[:2] != key:
        limit = limits.turn_timeout_s
        at = traj.turn_deadline = (*key, None if limit is None else asyncio.get_running_loop().time() + limit)
    try:
        async with asyncio.timeout_at(at[2]) as deadline:
            ids, logprobs, versions, finish = await _resumed_turn(ctx, traj, params, rid, deadline)
    except TimeoutError:
        if not deadline.expired():
            raise
        where = getattr(ctx.backend, "where", None)
        server = (where(traj.session_id) if where is not None else None) or ctx.backend.model_name
        raise BackendTimeout(
            f"model turn {traj.assistant_turns} exceeded limits.turn_timeout_s "
            f"{limits.turn_timeout_s:g} s on {server} (rid {rid})",
            server=server,
        ) from None
    finally:
        traj.metrics.generate_sequences += time.perf_counter() - t0
    if ctx.sampling.logprobs and logprobs is None:
        traj.logprobs_missing = True  # the batch then omits rollout_log_probs (fsm/output/batch.py says why)
    traj.append_generated(ids, logprobs, versions)
    traj.needs_tail = True
    traj.assistant_turns += 1
    traj.last_finish_reason = finish
    text = ctx.codec.turn_text(ids)
    # with no tools too: a call is answered "Unknown function" (verl)
    traj.pending_calls = ctx.parser.parse(text)
    traj.messages.append(ctx.codec.assistant_message(text, traj.pending_calls))  # as the template reads it


def _turn_request(
    ctx: RunContext,
    traj: Trajectory,
    context: list[int],
    ids: list[int],
    params: dict[str, Any],
    rid: str,
    attempt: int,
) -> GenerateRequest:
    """A turn's request: its context, plus what aborted attempts made (`ids`) when it is resumed."""
    return GenerateRequest(
        session_id=traj.node.route,  # a branch's: its parent's server
        prompt_ids=context + ids if ids else context,
        # the turn's own params (`Sampling.for_turn` made them) until a resume shrinks max_new_tokens
        sampling_params={**params, "max_new_tokens": params["max_new_tokens"] - len(ids)} if ids else params,
        rid=rid,
        group_id=traj.uid,
        return_logprob=ctx.sampling.logprobs,
        timeout_s=ctx.agent.limits.request_timeout_s,
        resumed=attempt,
        vocab_size=ctx.codec.vocab_size,
        turn=traj.assistant_turns,
    )


def _token_versions(gate: Any, result: GenerateResult, n: int, sent_to: int) -> list[int] | map[int]:
    """The weight version of each of the `n` new tokens (a request held across an update has two)."""
    per_token = result.extra.get("token_versions")
    if per_token is not None and len(per_token) >= n:
        per_token = per_token[:n]
        if n and per_token.count(per_token[0]) == n:  # one version: the usual case
            return [gate.version_of(per_token[0], sent_to)] * n
        seen = {v: gate.version_of(v, sent_to) for v in set(per_token)}  # one or two
        return map(seen.__getitem__, per_token)
    return [gate.version_of(result.weight_version, sent_to)] * n


def _note_context_cut(
    ctx: RunContext, traj: Trajectory, request: GenerateRequest, result: GenerateResult, made: bool
) -> None:
    """A finished turn that hit a full context says so on its row (`extra["context_cut"]`)."""
    if result.extra.get("context_cut"):  # the server's context was full: the row says so
        traj.extra["context_cut"] = result.extra["context_cut"]
    elif not made and result.finish_reason == "length" and request.sampling_params["max_new_tokens"] > 0:
        # nothing where tokens were asked, by "length": only a full context answers that (docs/engines.md),
        # whatever the client knows of the server's context length (else: the tokens the request held)
        known = getattr(ctx.backend, "context_length", None)
        traj.extra["context_cut"] = known or len(request.prompt_ids)


def _partial_turn(
    traj: Trajectory, want_logprobs: bool
) -> tuple[list[int], list[float] | None, list[int], int]:
    """Where a turn starts: empty, or what a pause's abort left of it before a snapshot (then attempt 1, a fresh
    rid: the aborted one may be known to the server); ids, logprobs, versions, attempt."""
    partial = getattr(traj, "partial_turn", None)
    if partial is None:
        return [], [] if want_logprobs else None, [], 0
    ids, logprobs, versions = list(partial[0]), partial[1] and list(partial[1]), list(partial[2])
    if want_logprobs and logprobs is None:
        return [], [], [], 1
    return ids, logprobs, versions, 1


async def _resumed_turn(
    ctx: RunContext,
    traj: Trajectory,
    params: dict[str, Any],
    rid: str,
    deadline: asyncio.Timeout | None = None,
    whole: bool = True,
) -> tuple[list[int], list[float] | None, list[int], str]:
    """The turn's tokens, their logprobs (None: asked for and not given), the weight version of each and
    its finish reason. `whole`: the trajectory is as it was before the action while the request is in flight
    (a `generate` turn; a summary's has begun its segment already).

    An abort (finish_reason "abort": a waiting-queue abort, /pause_generation, a weight update with
    abort_all_requests, a drain, our own deadline's /abort_request) is not the model's output. The tokens it
    produced are kept (mask 1, their logprobs) and the request is re-issued with them appended to its input and
    its max_new_tokens shrunk by as many, so the turn goes on where it stopped, as verl's fully-async
    rollouter and slime's partial rollouts do. Each resume has its own rid `{turn rid}_r{k}`: the aborted one
    may still be live at the server, which refuses a duplicate. Past `limits.max_resumes` the row fails.

    Every request first passes the engine's pause gate (`ctx.gate`); time spent there does not count against
    the turn's deadline, and an abort caused by the engine's own pause does not count against max_resumes.
    """
    limits = ctx.agent.limits
    max_new = params["max_new_tokens"]
    want_logprobs = ctx.sampling.logprobs
    gate = ctx.gate
    context = traj.context()  # the trajectory's own, grown per turn: its ids and JSON are not built again
    ids, logprobs, versions, attempt = _partial_turn(traj, want_logprobs)
    resumes = 0
    while True:
        if gate.paused:  # whole while it waits: a snapshot taken now keeps what the turn has so far
            traj.partial_turn = (list(ids), None if logprobs is None else list(logprobs), list(versions))
            if (waited := await gate.wait()) and deadline is not None and deadline.when() is not None:
                deadline.reschedule(deadline.when() + waited)  # type: ignore[operator]
        traj.partial_turn = None
        epoch, sent_to = gate.epoch, gate.version
        request = _turn_request(
            ctx, traj, context, ids, params, f"{rid}_r{attempt}" if attempt else rid, attempt
        )
        if whole:  # a snapshot may take the row as it was before this turn (PauseGate.waiting)
            gate.in_flight += 1  # a request in flight (`PauseGate.waiting` counts it once the gate is closed)
            try:
                result = await ctx.call_backend(traj, request)
            finally:
                gate.in_flight -= 1
        else:
            result = await ctx.call_backend(traj, request)
        traj.metrics.cached_tokens += result.cached_tokens or 0
        traj.metrics.prompt_tokens_sent += result.prompt_tokens or len(request.prompt_ids)
        aborted = result.finish_reason == "abort"
        new = result.token_ids[: max_new - len(ids)]
        new_logprobs = result.logprobs[: len(new)] if result.logprobs is not None else None
        if aborted and want_logprobs and new_logprobs is None:
            new, new_logprobs = [], []  # an abort without its logprob payload: regenerate, never invent them
        ids += new
        versions += _token_versions(gate, result, len(new), sent_to)
        if logprobs is not None:
            logprobs = logprobs + new_logprobs if new_logprobs is not None else None
        if not aborted:
            _note_context_cut(ctx, traj, request, result, bool(new))
            return ids, logprobs, versions, result.finish_reason
        if ids and ids[-1] in (params.get("stop_token_ids") or ()):
            return ids, logprobs, versions, "stop"  # the abort raced the turn's own end
        if len(ids) >= max_new:
            return ids, logprobs, versions, "length"
        attempt += 1
        if gate.paused or gate.epoch != epoch:
            traj.metrics.num_preempted += 1
            continue  # the engine's own pause: resumed at the gate, free of the resume budget
        if resumes >= limits.max_resumes:
            raise GenerationAborted(
                f"model turn {traj.assistant_turns} was aborted {resumes + 1} times, past limits.max_resumes "
                f"{limits.max_resumes}; last by {result.server}: {result.abort_message or 'no message'!r}",
                server=result.server,
            )
        resumes += 1
        traj.metrics.num_preempted += 1


async def call_tools(ctx: RunContext, traj: Trajectory) -> None:
    """Run the pending calls concurrently and append their results, in call order. Only well-formed calls
    take one of the max_parallel_calls slots: verl drops malformed calls before it takes the first N."""
    calls = traj.pending_calls  # cleared once answered: a snapshot taken while the loop is blocked in a tool
    try:  # (fsm/run/stream.py `snapshot_blocked`) writes the trajectory as it was before this action
        await _call_tools(ctx, traj, calls)
    finally:
        traj.pending_calls = []


async def _call_tools(ctx: RunContext, traj: Trajectory, calls: list[Any]) -> None:
    limits = ctx.agent.limits
    run: list[Any] = []
    extra: list[Any] = []
    order: list[tuple[bool, int]] = []
    valid = 0
    for call in calls:
        valid += call.error is None
        past = call.error is None and valid > limits.max_parallel_calls
        (extra if past else run).append(call)
        order.append((past, len(extra if past else run) - 1))
    active = traj.extra.get("active_tools")
    t0 = time.perf_counter()
    if len(run) == 1:  # the common case: no task and gather for one call
        outcomes = [await _run_call(ctx, traj, run[0], f"{traj.session_id}_c{traj.user_turns}_0", active)]
    else:
        outcomes = await asyncio.gather(
            *(
                _run_call(ctx, traj, call, f"{traj.session_id}_c{traj.user_turns}_{k}", active)
                for k, call in enumerate(run)
            )
        )
    traj.metrics.tool_calls += time.perf_counter() - t0
    traj.metrics.num_tool_calls += len(run)
    for outcome in outcomes:  # a child past the run's node bound (fsm/run/tree.py): the row's error
        if outcome.error == RUN_NODE_BOUND:
            raise RowError(outcome.text, "tree")
    named = ctx.agent.tool_rules.get(traj.state)
    if named:  # the state's retry/catch names these errors: they fail the round instead of being observations
        for outcome in outcomes:
            if outcome.error in named:
                traj.metrics.tool_errors += 1
                traj.metrics.retries += max(outcome.attempts - 1, 0)
                raise StateFailure(f"tool.{outcome.error}", outcome.text)
    answers: list[dict[str, Any]] = []
    for outcome in outcomes:
        for what, value in (("reward", outcome.reward), ("calc_reward score", outcome.score)):
            fault = None if value is None else score_fault(value)
            if fault:  # checked before any is kept: the row's error
                raise RowError(
                    f"reward: tool {outcome.name} on row {traj.row_name}: returned {what} {value!r}, {fault}",
                    "reward",
                )
    for outcome in outcomes:
        if outcome.reward is not None:  # a BaseTool may return None as its reward; verl leaves it out
            traj.tool_rewards.append(outcome.reward)
            traj.add_turn_reward("tool", outcome.reward)
        if outcome.score is not None:
            traj.tool_scores.append(outcome.score)
        if outcome.error:
            traj.metrics.tool_errors += 1
        traj.metrics.retries += max(outcome.attempts - 1, 0)
        answers.append(_tool_message(outcome.text, outcome.call_id))
    refusals: list[dict[str, Any] | None] = []
    for call in extra:
        traj.metrics.dropped_calls += 1
        text = (
            f"Error: too many tool calls in one turn; at most {limits.max_parallel_calls} run per turn, "
            f"so the call to '{call.name}' was not executed."
        )
        refusals.append(_tool_message(text, call.id) if limits.extra_calls == "error" else None)
    messages = []
    for past, k in order:
        message = refusals[k] if past else answers[k]
        if message is not None:
            messages.append(message)
    if messages and ctx.add_observation(traj, messages, role="tool"):
        traj.user_turns += 1


async def _run_call(
    ctx: RunContext, traj: Trajectory, call: Any, instance_id: str, active: list[str] | None
) -> Any:
    """One call: a tool's, or a child machine's run when the call names one (fsm/run/tree.py)."""
    if call.error is None and call.name in ctx.agent.spec.children and ctx.drive is not None:
        return await run_child(ctx, traj, call, ctx.drive)
    return await ctx.run_tool(traj, call, instance_id, active)


def _tool_message(text: str, call_id: str | None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "tool", "content": text}
    if call_id:
        msg["tool_call_id"] = call_id
    return msg


async def interact(ctx: RunContext, traj: Trajectory) -> None:
    """Ask the user/environment simulator for its reply; it may end the conversation."""
    inter = ctx.interaction
    if inter is None:
        raise RowError("the spec reached an interact action but declares no interaction")
    kwargs = traj.interaction_kwargs or {}
    if not traj.interaction_started:
        await inter.start_interaction(traj.session_id, **kwargs)
        traj.interaction_started = True
    messages = traj.messages_with_turns(ctx.codec.interaction_message)
    done, content, score, metrics = await inter.generate_response(traj.session_id, messages, **kwargs)
    content = encodable(content) if isinstance(content, str) else content
    if score is not None:
        score = float(score)
        if fault := score_fault(score):
            raise RowError(
                f"reward: interaction {ctx.agent.spec.interaction.class_} on row {traj.row_name}: "  # type: ignore[union-attr]
                f"returned turn score {score!r}, {fault}",
                "reward",
            )
        traj.turn_scores.append(score)
        traj.add_turn_reward("interaction", score)
    if metrics:
        traj.extra.setdefault("interaction_metrics", []).append(metrics)
    traj.should_terminate = bool(done)
    policy = ctx.agent.spec.interaction
    if done:
        traj.extra["final_feedback"] = content
        if policy is None or policy.final_reply == "keep_out":
            return  # the model never answers it: no tokens the model is trained on
    reply = [{"role": "user", "content": content}]
    overflow = policy.reply_overflow if policy is not None else "drop"
    if ctx.add_observation(traj, reply, role="user", overflow=overflow):
        traj.user_turns += 1


async def observe_error(ctx: RunContext, traj: Trajectory) -> None:
    """After a catch (fsm/run/failures.py): the model reads what failed. Each call of a failed tool round gets
    the error as its tool message; any other failure comes as a user message."""
    caught = next((f for f in reversed(traj.failures) if f.handled == "catch"), None)
    if caught is None:
        raise RowError(
            f"observe_error in {traj.state} with no caught failure: reach it through a state's catch"
        )
    message = caught.cause
    text = message if message.startswith("Error") else f"Error: {message}"
    calls, traj.pending_calls = traj.pending_calls, []
    if calls:
        messages, role = [_tool_message(text, call.id) for call in calls], "tool"
    else:
        messages, role = [{"role": "user", "content": text}], "user"
    if ctx.add_observation(traj, messages, role=role):
        traj.user_turns += 1


BUILTIN_ACTIONS: dict[str, Callable[[RunContext, Trajectory], Awaitable[None]]] = {
    "encode_prompt": encode_prompt,
    "generate": generate,
    "call_tools": call_tools,
    "interact": interact,
    "observe_error": observe_error,
}
