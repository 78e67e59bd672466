"""What comes out of a run: the padded batch in verl's layout, its file and its metrics (batch), the flat
per-sample form trainers map from (sample), the run directory, the record format of its trajectories.jsonl and
a run's statistics per edge and state (rundir), and a run kept there on SIGTERM, its files written, by the CLI
and by `generate_sequences(keep=RunDir(out))` alike (keep); and `BaseEngine` (engine), the engine
contract's shared half, which hands all of these out over each engine's primitives.

May import fsm.run (trajectories) and fsm.data; never the composition above it (fsm.api, fsm.adapters, fsm.cli).
"""
