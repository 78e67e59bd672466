"""verl 0.9.1's ToolAgentLoop with agentfsm's documented changes applied: the reference the generated parity
test holds fsm_agent to.

Each override below is one row of the "differences from verl" that specs/tool_agent.yaml documents, and
nothing else; when none of them fires (`fired` stays empty) the loop is verl's own, which the generated
test checks too. So "fsm_agent == AgentfsmRules" on every script means every difference between fsm_agent
and verl is one of these, exactly:

  malformed        verl's hermes parser drops a call (bad JSON, no string "name", no "arguments", no closing
                   tag); agentfsm answers it, in its place, with "Error: <what is wrong>".
  extra_calls      verl drops calls beyond max_parallel_calls silently; agentfsm answers each (extra_calls:
                   error), with no tool reward. Only well-formed calls count toward the limit, in both (verl
                   drops malformed calls before it takes the first N), so a malformed call answered in place
                   takes no slot.
  closer           after a turn cut without eos, agentfsm appends the template's "<|im_end|>\\n" (mask 0)
                   before the tool turn; verl appends the tool turn right after the cut text.
  empty_response   a trajectory whose model turn was empty (0 tokens) has response_ids [] in agentfsm; verl
                   returns prompt_ids[-0:], the whole prompt, as response_ids (with an empty mask).
  empty_logprobs   an empty response's logprobs are [] in agentfsm, None in verl.

The other documented differences do not change what a loop returns, and the harness compares them directly:
extra_fields["tool_scores"] and ["termination_reason"] (agentfsm only) and the requests' max_new_tokens and
stop_token_ids. This module imports verl: import it only where verl is installed.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, HermesToolParser
from verl.tools.schemas import ToolResponse

from fsm.families.parsers import HermesParser

MALFORMED = "\x00malformed"  # the name of a call verl would have dropped; its arguments are agentfsm's answer


async def _answer(text: str, reward: float | None) -> tuple[ToolResponse, float | None, dict]:
    return ToolResponse(text=text), reward, {}


class AnswerMalformed(HermesToolParser):
    """malformed: verl's calls, with the ones it drops put back in place as markers carrying agentfsm's
    error text. The well-formed calls must be exactly verl's (names and arguments), in order."""

    def __init__(self, tokenizer: Any, fired: set[str]):
        super().__init__(tokenizer)
        self.fired = fired

    async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None):
        content, kept = await super().extract_tool_calls(responses_ids, tools)
        verl_calls, calls = iter(kept), []
        for ours in HermesParser().parse(self.tokenizer.decode(responses_ids)):
            if ours.error is None:
                theirs = next(verl_calls)
                assert (theirs.name, json.loads(theirs.arguments)) == (ours.name, ours.arguments)
                calls.append(theirs)
            else:
                self.fired.add("malformed")
                calls.append(FunctionCall(name=MALFORMED, arguments=json.dumps(f"Error: {ours.error}")))
        assert next(verl_calls, None) is None, "verl parsed a call agentfsm calls malformed"
        return content, calls


class CloseCutTurns:
    """closer: verl's Continuous Token builder, but a tool turn after a turn cut without eos first gets
    eos + "\\n" (verl's Qwen builder inserts only the "\\n", and only after eos)."""

    def __init__(self, inner: Any, tokenizer: Any, fired: set[str]):
        self._inner, self._fired = inner, fired
        self._eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        (self._newline,) = tokenizer.encode("\n", add_special_tokens=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def merge_context_tokens(self, previous_messages, updated_messages, runtime_token_ids, *, tools=None):
        result = self._inner.merge_context_tokens(
            previous_messages, updated_messages, runtime_token_ids, tools=tools
        )
        if not runtime_token_ids or runtime_token_ids[-1] == self._eos:
            return result
        self._fired.add("closer")
        closer = [self._eos, self._newline]
        n = len(runtime_token_ids)
        return dataclasses.replace(
            result,
            token_ids=result.token_ids[:n] + closer + result.token_ids[n:],
            inserted_token_ids=closer + list(result.inserted_token_ids),
        )


class AgentfsmRules(ToolAgentLoop):
    """ToolAgentLoop with the overrides above. `extra_calls` is the fsm_agent entry's limits.extra_calls."""

    def __init__(self, *args: Any, extra_calls: str = "error", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fired: set[str] = set()
        self.tool_parser = AnswerMalformed(self.tokenizer, self.fired)
        self.continuous_token_builder = CloseCutTurns(
            self.continuous_token_builder, self.tokenizer, self.fired
        )
        self.extra_calls = extra_calls
        self.limit = self.max_parallel_calls
        self.index = 0  # of the next call within the current tool round

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any):
        out = await super().run(sampling_params, **kwargs)
        if not out.response_mask:  # the model said nothing
            if out.response_ids:  # verl: prompt_ids[-0:], the whole prompt
                self.fired.add("empty_response")
                out.response_ids = []
            if out.response_logprobs is None and sampling_params.get("logprobs"):
                self.fired.add("empty_logprobs")
                out.response_logprobs = []
        return out

    async def _handle_processing_tools_state(self, agent_data):
        """Every answered call of the round goes through _call_tool, which answers those past the limit:
        the malformed markers, verl's first N well-formed calls and, with extra_calls: error, the rest."""
        self.index = 0
        calls = agent_data.tool_calls
        extra = [c for c in calls if c.name != MALFORMED][self.limit :]
        if any(c.name == MALFORMED for c in calls[: self.limit]) and len(calls) > self.limit:
            self.fired.add("malformed among parallel calls")  # a marker sits where verl's N-th call would
        if extra and self.extra_calls == "error":
            self.fired.add("extra_calls")
        answered = [c for c in calls if self.extra_calls == "error" or all(c is not e for e in extra)]
        agent_data.tool_calls, self.max_parallel_calls = answered, len(answered)
        try:
            return await super()._handle_processing_tools_state(agent_data)
        finally:
            agent_data.tool_calls, self.max_parallel_calls = calls, self.limit

    def _build_assistant_message(self, content, agent_data):
        """The message lists verl's own calls: the malformed markers are agentfsm's, not the model's."""
        calls = agent_data.tool_calls
        agent_data.tool_calls = [c for c in calls if c.name != MALFORMED]
        try:
            return super()._build_assistant_message(content, agent_data)
        finally:
            agent_data.tool_calls = calls

    def _call_tool(self, tool_call, tools_kwargs, agent_data):  # called in call order; returns the awaitable
        if tool_call.name == MALFORMED:
            return _answer(json.loads(tool_call.arguments), 0.0)
        k, self.index = self.index, self.index + 1
        if k >= self.limit:
            return _answer(
                f"Error: too many tool calls in one turn; at most {self.limit} run per turn, so the "
                f"call to '{tool_call.name}' was not executed.",
                None,
            )
        return super()._call_tool(tool_call, tools_kwargs, agent_data)
