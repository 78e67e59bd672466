"""The spec as data: YAML read within bounds and validated into a typed `AgentSpec` with `file:line:col`
diagnostics (loader; the models in model, its `context:` section in contexts, the strict base and numeric
bounds every part shares in base), the name registries for guards, actions and import paths, and
guards compiled from their YAML form (registry).

Imports nothing else of fsm: reading and validating a spec needs no tokenizer, backend or torch.
"""
