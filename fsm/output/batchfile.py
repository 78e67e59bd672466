"""batch.pt, the padded batch on disk: loadable the safe way, `torch.load(path)` with torch's default
`weights_only=True`, which refuses numpy arrays (they unpickle through arbitrary globals). So the file holds
only tensors and plain Python data: each non-tensor column is a list (numpy values inside a row's columns, as
parquet gives them, become lists and numbers), with its numpy dtype beside it, and `load_batch` turns it back
into the RolloutBatch that `generate_sequences` returns (numpy object arrays, as verl's DataProto holds them).

The keys are documented in docs/contracts.md ("batch.pt").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from fsm.output.batch import RolloutBatch

FORMAT = "agentfsm.batch/2"  # /1: numpy arrays pickled inside (torch.load needed weights_only=False)


def plain(value: Any) -> Any:
    """`value` as data torch's safe unpickler takes: dicts, lists, str, numbers, None and tensors."""
    if isinstance(value, (str, int, float, bool, type(None), torch.Tensor)):
        return value
    if isinstance(value, dict):
        return {plain(k) if not isinstance(k, str) else k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)  # anything else a row may hold (a date, a custom object): its text


def to_file(batch: Any) -> dict[str, Any]:
    """What torch.save writes: {"format", "batch", "non_tensor_batch", "non_tensor_dtypes", "meta_info"}."""
    return {
        "format": FORMAT,
        "batch": {key: value for key, value in batch.batch.items()},
        "non_tensor_batch": {key: plain(values) for key, values in batch.non_tensor_batch.items()},
        "non_tensor_dtypes": {key: str(values.dtype) for key, values in batch.non_tensor_batch.items()},
        "meta_info": plain(batch.meta_info),
    }


def save_batch(batch: Any, path: str | Path) -> None:
    torch.save(to_file(batch), path)


def load_batch(path: str | Path) -> RolloutBatch:
    """A run's batch.pt (weights_only=True: nothing in it runs code) as the RolloutBatch the run produced."""
    saved = torch.load(path, weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(
            f"{path}: not an {FORMAT} batch.pt (an older one loads with torch.load(path, "
            "weights_only=False), from a source you trust)"
        )
    tensors = saved["batch"]
    size = [len(next(iter(tensors.values())))] if tensors else [0]
    non_tensors = {}
    for key, values in saved["non_tensor_batch"].items():
        dtype = saved["non_tensor_dtypes"][key]
        if dtype == "object":
            column = np.empty(len(values), dtype=object)
            column[:] = values
        else:
            column = np.asarray(values, dtype=dtype)
        non_tensors[key] = column
    return RolloutBatch(TensorDict(tensors, batch_size=size), non_tensors, saved["meta_info"])
