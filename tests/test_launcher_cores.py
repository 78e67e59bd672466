"""Several vLLM CPU replicas launched together take cores of their own (backends/launcher.py `cpu_shares`):
vLLM's default ("auto") reserves one core for its front end and binds each replica's OpenMP threads to the
rest, so on a 2-core machine every replica ran on core 0 (seen in their logs: `core ids=[0]` twice)."""

from __future__ import annotations

import pytest

from backends.launcher import BIND_ENV, VLLMLauncher, cpu_shares


def test_replicas_split_the_cores_in_equal_runs():
    assert cpu_shares(2, [0, 1]) == ["0", "1"]
    assert cpu_shares(2, [0, 1, 2, 3, 4]) == ["0,1", "2,3,4"]  # the last takes what is left
    assert cpu_shares(4, [2, 3, 5, 7, 11, 13, 17, 19]) == ["2,3", "5,7", "11,13", "17,19"]
    assert cpu_shares(1, [0, 1]) == ["0,1"]


def test_more_replicas_than_cores_take_one_core_each_in_turn():
    assert cpu_shares(3, [0, 1]) == ["0", "1", "0"]


def launcher(tmp_path, monkeypatch, dp: int, device: str | None = "cpu", **options) -> VLLMLauncher:
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    return VLLMLauncher("model", dp=dp, device=device, log_dir=tmp_path, base_port=9000, **options)


def test_each_cpu_replica_binds_its_own_cores(tmp_path, monkeypatch):
    lch = launcher(tmp_path, monkeypatch, dp=2)
    assert [lch.replica_env(i) for i in range(2)] == [{BIND_ENV: "0,1"}, {BIND_ENV: "2,3"}]


@pytest.mark.parametrize("device", ["cpu", "cuda", None])
def test_one_replica_keeps_vllms_own_binding(tmp_path, monkeypatch, device):
    assert launcher(tmp_path, monkeypatch, dp=1, device=device).replica_env(0) == {}


def test_a_binding_the_user_gave_is_kept(tmp_path, monkeypatch):
    lch = launcher(tmp_path, monkeypatch, dp=2, env={BIND_ENV: "0-3|0-3"})
    assert lch.replica_env(0) == {} and lch.env[BIND_ENV] == "0-3|0-3"
    monkeypatch.setenv(BIND_ENV, "nobind")
    assert lch.replica_env(1) == {}
