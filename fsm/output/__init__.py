"""What comes out of a run: the padded batch in verl's layout (batch), the flat per-sample form trainers map
from (sample), a batch's metrics (metrics), and the run directory the CLI writes (rundir).

May import fsm.run (trajectories) and fsm.data; never the composition above it (fsm.api, fsm.adapters, fsm.cli).
"""
