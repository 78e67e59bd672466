"""The agent file an OpenRLHF user writes: `--train.agent_func_path tests/openrlhf/agent.py`."""

from fsm.adapters.openrlhf import agent_executor

AgentExecutor = agent_executor("calculator")
