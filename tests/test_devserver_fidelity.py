"""The dev server answers as real SGLang does: every scenario of tests/sglang/scenarios.py, run against the
dev server over the tiny model, compared field by field with real SGLang 0.5.23's recorded answers
(tests/fixtures/sglang, written by `python -m tests.sglang.record`). Shapes (keys and JSON types) must be
equal everywhere; statuses, content types, error texts, finish reasons, greedy token ids, cache counts and
weight versions where each scenario says so. Needs no SGLang.
"""

from __future__ import annotations

import json

import pytest

from backends.devserver import DevServer
from tests.conftest import ASSETS, REPO
from tests.sglang.scenarios import SCENARIOS, differences, run_scenario

FIXTURES = REPO / "tests" / "fixtures" / "sglang"


def recorded(name: str) -> list[dict]:
    return json.loads((FIXTURES / f"{name}.json").read_text())["exchanges"]


@pytest.fixture(scope="module")
def hf_options():
    return {"torch_threads": 1, "device": "cpu"}


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_dev_server_answers_as_recorded_sglang(name, hf_options):
    from backends.hf import HFBackend

    backend = HFBackend(ASSETS, **hf_options)
    try:
        async with DevServer(backend, model_path=str(ASSETS)) as dev:
            exchanges = await run_scenario(name, dev.url, str(ASSETS))
    finally:
        await backend.close()
    problems = differences(recorded(name), exchanges)
    assert not problems, "\n".join(problems)


def test_every_scenario_has_a_recording_and_the_comparison_can_fail():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(SCENARIOS)
    real = recorded("generate")
    greedy = next(e for e in real if e["name"] == "greedy")
    changed = [{**greedy, "body": {**greedy["body"], "output_ids": greedy["body"]["output_ids"][:-1] + [0]}}]
    assert differences([greedy], changed) == [
        f"greedy (POST /generate): output_ids = "
        f"{json.dumps(changed[0]['body']['output_ids'])}, SGLang "
        f"{json.dumps(greedy['body']['output_ids'])}"
    ]
    meta = {k: v for k, v in greedy["body"]["meta_info"].items() if k != "dp_rank"}
    assert 'greedy (POST /generate): body.meta_info.dp_rank missing (SGLang: "null")' in differences(
        [greedy], [{**greedy, "body": {**greedy["body"], "meta_info": meta}}]
    )
