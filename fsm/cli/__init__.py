"""`agentfsm`, the command line: its arguments (args), the commands (commands: validate, render, run, bench...)
and how a run's outcome is reported (outcome). Composes through fsm.api; `python -m fsm.cli` runs it too.
"""
