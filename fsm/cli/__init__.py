"""`agentfsm`, the command line: each command's flags, their types and one-line errors (args, gateway_args),
the commands (commands: run, gateway, replay, and how a command ends; resume: `run --resume`'s checks; views:
validate, schema, render, show; bundled: bench, dev-server), the servers a run launches (launch). Composes
through fsm.api; `python -m fsm.cli` runs it too.
"""
