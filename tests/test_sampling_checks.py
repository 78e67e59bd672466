"""Sampling parameters are checked once, where the run's Sampling is built (fsm/run/context.py), the same for
every engine: a value one engine would read differently (vLLM takes top_k -2 as "off", SGLang refuses it) is
refused before any request, in one line naming the parameter, through the API and through the CLI."""

from __future__ import annotations

import pytest

from backends.scripted import echo_backend
from fsm import RolloutEngine
from specs.calculator import make_prompts
from tests.conftest import ASSETS, REPO
from tests.test_cli import echo_server, one_line_error, run_argv  # noqa: F401  (echo_server: a fixture)

BAD = [
    ({"top_k": -2}, "sampling parameter top_k: top_k must be -1 (whole vocabulary) or >= 1 (got top_k=-2)"),
    ({"top_k": 0}, "sampling parameter top_k:"),
    ({"stop_token_ids": ["x"]}, "sampling parameter stop_token_ids.0: Input should be a valid integer"),
    (
        {"stop_token_ids": [-1]},
        "sampling parameter stop_token_ids.0: Input should be greater than or equal to 0",
    ),
    (
        {"stop_token_ids": [10**9]},
        "sampling parameter stop_token_ids: 1000000000 is not a token id of this model",
    ),
    ({"temperature": float("nan")}, "sampling parameter temperature: Input should be a finite number"),
    ({"top_p": 0}, "sampling parameter top_p: Input should be greater than 0"),
    ({"max_new_tokens": 0}, "sampling parameter max_new_tokens: Input should be greater than 0"),
    ({"topk": 5}, "unknown sampling parameter(s) ['topk']"),
]


@pytest.mark.parametrize(("params", "message"), BAD, ids=[str(p) for p, _ in BAD])
def test_the_api_refuses_a_bad_parameter_in_one_line_naming_it(tok, params, message):
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        with pytest.raises(ValueError) as info:
            engine.generate_sequences(make_prompts(1), sampling_params=params)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_good_parameters_reach_the_request_as_their_types(tok):
    seen = []

    class Recording:
        def __init__(self):
            self.inner = echo_backend()

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def generate(self, request):
            seen.append(dict(request.sampling_params))
            return await self.inner.generate(request)

    with RolloutEngine("calculator", tok, backend=Recording()) as engine:
        engine.generate_sequences(
            make_prompts(1), sampling_params={"top_k": 20.0, "stop_token_ids": [7], "top_p": 0.5}
        )
    assert seen and seen[0]["top_k"] == 20 and type(seen[0]["top_k"]) is int
    assert 7 in seen[0]["stop_token_ids"] and seen[0]["top_p"] == 0.5


SPEC_BAD = [
    ("top_k: -2", "sampling.top_k: top_k must be -1 (whole vocabulary) or >= 1"),
    ('stop_token_ids: ["x"]', "sampling.stop_token_ids.0: Input should be a valid integer"),
]


@pytest.mark.parametrize(("line", "message"), SPEC_BAD, ids=[line for line, _ in SPEC_BAD])
@pytest.mark.parametrize("command", ["validate", "run"])
def test_the_cli_refuses_a_spec_with_a_bad_parameter(capsys, tmp_path, command, line, message):
    spec = tmp_path / "agent.yaml"
    spec.write_text(f"extends: {REPO / 'specs' / 'calculator.yaml'}\nsampling:\n  {line}\n")
    code = __import__("fsm.cli.commands", fromlist=["main"]).main(
        [command, str(spec), "--tokenizer", str(ASSETS)] if command == "run" else [command, str(spec)]
    )
    captured = capsys.readouterr()
    assert code == 2, captured
    (diag,) = (captured.out + captured.err).splitlines()
    assert diag.startswith(f"{spec}:3:") and message in diag, diag


def test_the_cli_refuses_a_stop_id_past_the_vocabulary_before_any_request(capsys, tmp_path, echo_server):  # noqa: F811
    spec = tmp_path / "agent.yaml"
    spec.write_text(
        f"extends: {REPO / 'specs' / 'calculator.yaml'}\nsampling:\n  stop_token_ids: [999999999]\n"
    )
    argv = run_argv(echo_server, tmp_path / "out", "--num-prompts", "1")
    argv[1] = str(spec)
    line = one_line_error(capsys, argv)
    assert line.startswith(
        f"agentfsm: {spec}: sampling parameter stop_token_ids: 999999999 is not a token id of "
        "this model (vocabulary of "
    ), line
    assert not (tmp_path / "out" / "summary.json").exists()
