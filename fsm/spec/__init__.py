"""The spec as data: YAML read within bounds and validated into a typed `AgentSpec` with `file:line:col`
diagnostics (loader, model, contexts, base), and the name registries and compiled guards (registry).

Imports nothing else of fsm: reading and validating a spec needs no tokenizer, backend or torch.
"""
