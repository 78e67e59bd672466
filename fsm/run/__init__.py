"""The run: a spec compiled into one shared machine (compile -> agent), and the driver that takes many
trajectories through it concurrently on one event loop (runtime), with what actions share (context), the built-in
actions and interactions (actions, interaction), each sample's state (trajectory), the continuous mode (stream),
snapshots at state boundaries (snapshot), signals during a run (signals: the run they stop and keep is
fsm/output/keep.py's), the engine's control commands and calls (engine), the tracer
protocol (tracer), and the engine's working parts on its private loop thread (local: `LoopThread`).

May import fsm.spec, fsm.data, fsm.tools and fsm.families; never what comes out (fsm.output) or the composition
above it (fsm.api, fsm.adapters, fsm.cli).
"""
