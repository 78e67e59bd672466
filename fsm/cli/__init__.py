"""`agentfsm`, the command line: each command's flags (args, gateway_args; their types and one-line usage errors
in usage), the commands (commands: run, gateway, replay, bench, dev-server; views: validate, schema, render,
show), the servers a run launches (launch) and how a command ends (outcome). Composes through fsm.api;
`python -m fsm.cli` runs it too.
"""
