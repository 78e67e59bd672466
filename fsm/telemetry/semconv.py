"""The attribute names agentfsm's spans carry, in one place so that spans, shapes and tests agree.

`gen_ai.*` follow the OpenTelemetry GenAI semantic conventions, as string literals: the semconv package marks
its GenAI constants deprecated, and tests/test_telemetry.py checks that ours still equal them. `fsm.*` and
`agentfsm.*` are ours. Every span also carries OpenInference's `openinference.span.kind`, a constant of its
shape: Arize Phoenix and other LLM trace UIs show a span without it as UNKNOWN.
"""

# GenAI semantic conventions
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_AGENT_DESCRIPTION = "gen_ai.agent.description"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE = "gen_ai.tool.type"
GEN_AI_TOOL_DESCRIPTION = "gen_ai.tool.description"
# opt-in content (capture_content=True)
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
GEN_AI_TOOL_DEFINITIONS = "gen_ai.tool.definitions"
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT = "gen_ai.tool.call.result"
# stable, borrowed by GenAI
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
# OpenInference (Arize Phoenix): the span kind, one of its values below
OPENINFERENCE_SPAN_KIND = "openinference.span.kind"
OI_AGENT, OI_CHAIN, OI_LLM, OI_TOOL = "AGENT", "CHAIN", "LLM", "TOOL"  # root, transitions, model, tool spans
# agentfsm's own: the state machine (fsm.*) and the rollout (agentfsm.*)
FSM_SOURCE = "fsm.source"
FSM_DEST = "fsm.dest"
FSM_GUARD = "fsm.guard"  # the edge's guard as written, "default" for the unguarded edge
FSM_REASON = "fsm.reason"  # the edge's reason, when it has one
FSM_EDGE = "fsm.edge"  # the edge's global index (what run statistics key on)
FSM_TURN = "fsm.turn"  # model turns completed when the transition fired
FSM_TOKENS_MODEL = "fsm.tokens.model"  # tokens the model generated in this state (mask 1)
FSM_TOKENS_OBSERVATION = "fsm.tokens.observation"  # tokens appended with mask 0 (tool/user/template)
FSM_TERMINATION_REASON = "fsm.termination_reason"
FSM_TURNS = "fsm.turns"  # verl's num_turns
FSM_TRANSITIONS = "fsm.transitions"
FSM_FINAL_STATE = "fsm.final_state"
AGENT_HASH = "agentfsm.agent.hash"
INDEX = "agentfsm.index"  # the trajectory's position in the batch
UID = "agentfsm.uid"  # the row's uid: a GRPO group
SAMPLE = "agentfsm.sample"  # the sample's index within its group
REWARD = "agentfsm.reward_score"
ERROR = "agentfsm.error"
PROMPT_TOKENS = "agentfsm.tokens.prompt"
RESPONSE_TOKENS = "agentfsm.tokens.response"
WEIGHT_VERSION_MIN = "agentfsm.weight_version.min"  # over the trajectory's generated tokens
WEIGHT_VERSION_MAX = "agentfsm.weight_version.max"
# Events on the root spans of trajectories in flight when the engine pauses, resumes or updates weights
# (fsm/api.py): "pause" {agentfsm.pause.mode}, "resume", "weight_update" {agentfsm.weight_version}.
PAUSE_MODE = "agentfsm.pause.mode"
WEIGHT_VERSION = "agentfsm.weight_version"
MODEL_TOKENS = "agentfsm.tokens.model"
ROUTE = "agentfsm.route"  # how a router placed the call: sticky | new | group | moved
TOOL_ATTEMPTS = "agentfsm.tool.attempts"
# A state's declared failure rules (fsm/spec/failures.py): a catch edge's errors; on the root, the retries and
# catches of the trajectory, and one event per handled failure ("agentfsm.retry" / "agentfsm.catch").
CATCH_ERRORS = "fsm.catch.errors"
RETRIES = "agentfsm.retries"
CATCHES = "agentfsm.catches"
FAILURE_STATE = "agentfsm.failure.state"
FAILURE_ERROR = "agentfsm.failure.error"
FAILURE_ATTEMPT = "agentfsm.failure.attempt"
FAILURE_MESSAGE = "agentfsm.failure.message"
FAILURE_TO = "agentfsm.failure.to"
INPUT_TOKEN_IDS = "agentfsm.input_token_ids"  # opt-in content
OUTPUT_TOKEN_IDS = "agentfsm.output_token_ids"  # opt-in content
