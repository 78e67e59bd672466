"""What comes out of a run: verl's padded batch, its file and metrics (batch), the flat per-sample form
trainers map from (sample), the run directory and its formats (rundir), a kept, resumable run (keep), and
`BaseEngine` (engine), the engine contract's shared half, which hands these out over each engine's primitives.

May import fsm.run (trajectories) and fsm.data; never the composition above it (fsm.api, fsm.adapters, fsm.cli).
"""
