"""The gateway: agents written in other harnesses (the OpenAI Agents SDK, LangGraph, the anthropic SDK, any
program that speaks an OpenAI-, Anthropic- or Gemini-compatible HTTP API) run as a state's action, and each of their
model calls is recorded token-exact on the row's trajectory. Its modules: docs/architecture.md; how to use it:
docs/gateway.md. It sits with the composition layer, beside fsm/api.py: nothing in fsm imports it (a spec names it in
`imports:`).
"""

from fsm.gateway.harness import HarnessCall, gateway_generate, harness
from fsm.gateway.record import GatewayError, LimitReached
from fsm.gateway.server import Gateway, GatewayLimits, Session

__all__ = [
    "Gateway",
    "GatewayError",
    "GatewayLimits",
    "HarnessCall",
    "LimitReached",
    "Session",
    "gateway_generate",
    "harness",
]
