"""What every part of a spec shares: a strict, frozen model (an unknown key is an error, a loaded spec never
changes) and the upper bounds a number in it may take."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A part of a spec: unknown keys refused (a typo is an error, not a default), frozen once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# Upper bounds a limit may take: past them a value is a typo (1e12 tokens), not a setting, and would fail
# only at collation, after the whole rollout. A padded batch is rows x (prompt_length + response_length).
MAX_TOKENS = 1 << 20
MAX_TURNS = 100_000
MAX_TRANSITIONS = 100_000  # a spinning cycle's path: what it costs a row, docs/errors.md ("Cycles")
MAX_SECONDS = 7 * 24 * 3600.0
