"""Deprecated path, kept for verl configs written before the adapters moved: name `fsm.adapters.verl.FSMAgentLoop`."""

from fsm.adapters.verl import FSMAgentLoop  # noqa: F401
