"""Benchmarks behind `agentfsm bench ...`; imported lazily by the CLI, never by the engine."""
