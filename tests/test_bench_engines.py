"""bench/engines.py over two scripted dev servers (subprocesses): each server's numbers, the tokens compared
across them, and the client under load in an engine's first batch and in its second (the steady state)."""

from __future__ import annotations

from backends.scripted import scripted_servers
from bench.engines import bench_engines


def test_bench_engines_reports_first_and_steady_batches(capsys):
    with scripted_servers(2) as urls:
        out = bench_engines(urls, n=2, repeats=1, in_flight=6)
    assert out["tokens_equal"] is True
    for url in urls:
        s = out["servers"][url]
        assert s["model_calls"] >= 2 and s["failed"] == 0 and s["in_flight_failed"] == 0
        for key in ("client_cpu_ms_per_call", "in_flight_client_cpu_ms_per_call"):
            assert s[key] > 0, key
        assert s["in_flight_steady_client_cpu_ms_per_call"] > 0
    said = capsys.readouterr().err
    assert "in an engine's first batch" in said and "in its second" in said
