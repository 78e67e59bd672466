"""`agentfsm bench vs-verl` runs where verl is installed: every variant gives verl's tokens, and the JSON has
each variant's CPU per trajectory and its ratio to verl's."""

from __future__ import annotations

from tests.verl.harness import needs_verl


@needs_verl
def test_bench_vs_verl_small():
    from bench.vs_verl import KINDS, bench_vs_verl

    out = bench_vs_verl(n=4, repeats=1)  # asserts inside that every variant's response ids equal verl's
    assert out["verl_version"] == "0.9.1" and out["trajectories"] == 4
    assert out["response_tokens"] > 0
    for kind in KINDS:
        assert out[kind]["cpu_us_per_trajectory"] > 0
    assert out["verl"]["vs_verl"] == 1.0
