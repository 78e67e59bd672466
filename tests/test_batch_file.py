"""batch.pt loads the safe way (torch.load's default weights_only=True), `fsm.load_batch` gives back the batch
the run produced, and docs/contracts.md documents every key the file holds."""

from __future__ import annotations

import re

import numpy as np
import torch

import fsm
from backends.scripted import echo_backend
from fsm import RolloutEngine
from fsm.cli.commands import main
from fsm.output.batch import save_batch
from specs.calculator import make_prompts
from tests.conftest import REPO
from tests.test_cli import echo_server, run_argv  # noqa: F401  (echo_server: a fixture)


def documented() -> dict[str, set[str]]:
    """The keys each table of docs/contracts.md's "batch.pt" section names in its first column."""
    text = (REPO / "docs" / "contracts.md").read_text()
    section = text.split("## batch.pt", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, set[str]] = {}
    for title, body in re.findall(r"\n(Top level|`\w+`)[^\n]*:\n\n((?:\|[^\n]*\n)+)", section):
        rows = [line.split("|")[1] for line in body.splitlines()[2:]]
        tables[title.strip("`")] = {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}
    return tables


def test_the_cli_writes_a_batch_torch_loads_safely_and_every_key_is_documented(capsys, tmp_path, echo_server):  # noqa: F811
    out = tmp_path / "out"
    assert main(run_argv(echo_server, out, "--num-prompts", "3", "-q")) == 0
    saved = torch.load(out / "batch.pt")  # torch's default: weights_only=True
    docs = documented()
    assert set(saved) == docs["Top level"]
    assert set(saved["batch"]) <= docs["batch"]
    assert {
        "prompts",
        "responses",
        "response_mask",
        "rollout_log_probs",
        "rm_scores",
        "weight_versions",
    } <= set(saved["batch"])
    row_columns = {"data_source", "extra_info", "reward_model"}  # the calculator's rows: "every other column"
    assert set(saved["non_tensor_batch"]) - row_columns <= docs["non_tensor_batch"], set(
        saved["non_tensor_batch"]
    )
    assert set(saved["meta_info"]) <= docs["meta_info"], set(saved["meta_info"])
    for key, tensor in saved["batch"].items():
        assert tensor.dtype == {"rollout_log_probs": torch.float32, "rm_scores": torch.float32}.get(
            key, torch.int64
        ), key

    batch = fsm.load_batch(out / "batch.pt")
    assert len(batch) == 3 and list(batch.non_tensor_batch["uid"]) == ["calc-0-0", "calc-0-1", "calc-0-2"]
    assert (
        batch.non_tensor_batch["uid"].dtype == object
        and batch.non_tensor_batch["segment_index"].dtype == np.int32
    )
    assert batch.non_tensor_batch["state_path"][0] == saved["non_tensor_batch"]["state_path"][0]
    for key, tensor in saved["batch"].items():
        assert torch.equal(batch.batch[key], tensor), key


def test_numpy_values_in_rows_come_back_as_plain_data(tok, tmp_path):
    """Parquet rows hold numpy arrays and scalars: the file keeps their values as lists and numbers."""
    rows = make_prompts(2)
    rows[0]["extra_info"] = {
        "index": np.int64(7),
        "weights": np.array([1.5, 2.5]),
        "tags": np.array(["a"], dtype=object),
    }
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        batch = engine.generate_sequences(rows)
    save_batch(batch, tmp_path / "batch.pt")
    saved = torch.load(tmp_path / "batch.pt", weights_only=True)
    assert saved["non_tensor_batch"]["extra_info"][0] == {"index": 7, "weights": [1.5, 2.5], "tags": ["a"]}
    back = fsm.load_batch(tmp_path / "batch.pt")
    assert back.meta_info["sampling"] == batch.meta_info["sampling"]
    assert list(back.non_tensor_batch["trajectory_id"]) == list(batch.non_tensor_batch["trajectory_id"])
