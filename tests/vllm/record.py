"""Record real vLLM's answers on every route the client uses into tests/fixtures/vllm/exchanges.json.

    python -m tests.vllm.record                 # launches vLLM from .venv-vllm ($VLLM_VENV), CPU, padded tiny model
    python -m tests.vllm.record --url URL --model DIR   # a server already serving `backends.tiny.head_pad DIR`

Re-run it when vLLM changes (after `bash .ci/vllm_env.sh` with a new pin); tests/test_vllm_wire.py then says
where the client no longer reads vLLM's answers as it should. The exchanges put the server back as they found
it (weights on DIR, version "default" relabelled at the end, not paused).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from tests.sglang.scenarios import PROMPT

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "vllm"
GREEDY = {"temperature": 0.0, "logprobs": 0, "detokenize": False}
WAIT_S = 120.0


async def exchanges(url: str, model: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def call(
            name: str, method: str, path: str, body: Any = None, params: dict | None = None
        ) -> Any:
            async with http.request(method, url + path, json=body, params=params) as resp:
                text = await resp.text()
                try:
                    parsed = json.loads(text) if text else None
                except ValueError:
                    parsed = text
                out.append(
                    {
                        "name": name,
                        "method": method,
                        "path": path,
                        "params": params,
                        "request": body,
                        "status": resp.status,
                        "body": parsed,
                    }
                )
                return parsed

        def gen(rid: str, max_tokens: int, prompt: list[int] = PROMPT, **params: Any) -> dict[str, Any]:
            return {
                "token_ids": prompt,
                "request_id": rid,
                "sampling_params": {**GREEDY, "max_tokens": max_tokens, **params},
            }

        async def until_running() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT_S
            while True:
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
                if running and float(running[0].split()[-1]) >= 1:
                    await asyncio.sleep(0.3)  # a few tokens made
                    return
                assert loop.time() < deadline, "no request started running"
                await asyncio.sleep(0.02)

        await call("health", "GET", "/health")
        await call("models", "GET", "/v1/models")
        await call("weight_info", "GET", "/weight_info")
        await call("is_paused", "GET", "/is_paused")
        await call("greedy", "POST", "/inference/v1/generate", gen("rec_greedy", 8))
        await call("stop_id", "POST", "/inference/v1/generate", gen("rec_stop", 8, stop_token_ids=[485]))
        await call("eos", "POST", "/inference/v1/generate", gen("rec_eos", 300, stop_token_ids=[2]))
        await call(
            "no_logprobs",
            "POST",
            "/inference/v1/generate",
            {
                "token_ids": PROMPT,
                "request_id": "rec_nolp",
                "sampling_params": {"temperature": 0.0, "max_tokens": 3},
            },
        )
        await call("zero_budget", "POST", "/inference/v1/generate", gen("rec_zero", 0))
        await call("bad_top_p", "POST", "/inference/v1/generate", gen("rec_topp", 3, top_p=7.0))
        await call("unknown_param", "POST", "/inference/v1/generate", gen("rec_unknown", 3, max_new_tokens=3))
        await call("too_long", "POST", "/inference/v1/generate", gen("rec_long", 10, prompt=[5] * 4100))
        await call("at_the_edge", "POST", "/inference/v1/generate", gen("rec_edge", 10, prompt=[5] * 4093))
        await call("empty_prompt", "POST", "/inference/v1/generate", gen("rec_empty", 3, prompt=[]))
        # an abort mid-generation answers with the tokens made so far
        turn = asyncio.ensure_future(
            call("aborted", "POST", "/inference/v1/generate", gen("rec_abort", 400, ignore_eos=True))
        )
        await until_running()
        await call(
            "abort", "POST", "/inference/v1/abort_requests", {"request_ids": ["generate-tokens-rec_abort"]}
        )
        await turn
        # each pause mode with a request in flight
        for mode in ("abort", "keep", "wait"):
            turn = asyncio.ensure_future(
                call(
                    f"paused_{mode}",
                    "POST",
                    "/inference/v1/generate",
                    gen(f"rec_pause_{mode}", 200, ignore_eos=True),
                )
            )
            await until_running()
            await call(f"pause_{mode}", "POST", "/pause", params={"mode": mode})
            await call(f"is_paused_{mode}", "GET", "/is_paused")
            await call(f"resume_{mode}", "POST", "/resume")
            await turn
        await call("pause_bad_mode", "POST", "/pause", params={"mode": "retract"})
        # weights: reload from a checkpoint and relabel; a weight-transfer session without a configured engine
        await call(
            "reload_early",
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(Path(model) / "early")}},
        )
        await call("update_weight_version", "POST", "/update_weight_version", {"new_version": "7"})
        await call("weight_info_after", "GET", "/weight_info")
        await call("early_versions", "POST", "/inference/v1/generate", gen("rec_early", 4))
        await call(
            "reload_back",
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": model}},
        )
        await call("update_weight_version_back", "POST", "/update_weight_version", {"new_version": "default"})
        await exact(call, model)
        await call("start_weight_update", "POST", "/start_weight_update")
        await call("reset_prefix_cache", "POST", "/reset_prefix_cache")
    return out


async def exact(call: Any, model: str) -> None:
    """What an exact update reads (backends/vllm.py, backends/vllm_reload.py): the server's config, kept to
    the two entries the client reads, and the worker extension's reload report."""
    await call("server_info", "GET", "/server_info", params={"config_format": "json"})
    await call(
        "exact_reload",
        "POST",
        "/collective_rpc",
        {"method": "agentfsm_reload_weights", "kwargs": {"weights_path": model}},
    )


def trimmed(exchanges: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """/server_info holds the whole config, environment and system: only what the client reads is kept."""
    for e in exchanges:
        if e["path"] == "/server_info" and isinstance(e["body"], dict):
            config = e["body"]["vllm_config"]
            e["body"] = {
                "vllm_config": {
                    "parallel_config": {
                        "worker_extension_cls": config["parallel_config"].get("worker_extension_cls")
                    },
                    "device_config": {"device": config["device_config"].get("device")},
                }
            }
    return exchanges


async def launch_and_record() -> list[dict[str, Any]]:
    from backends.launcher import VLLMLauncher
    from backends.tiny.head_pad import convert_tiny
    from tests.vllm.conftest import PYTHON, READY_S, free_port

    with tempfile.TemporaryDirectory() as tmp:
        model = convert_tiny(Path(tmp) / "model")
        async with VLLMLauncher(
            str(model),
            base_port=free_port(),
            device="cpu",
            python=str(PYTHON),
            log_dir=Path(tmp) / "logs",
            startup_timeout_s=READY_S,
        ) as launcher:
            return await exchanges(launcher.urls[0], str(model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running vLLM server (default: launch one)")
    ap.add_argument("--model", help="with --url: the padded model directory it serves")
    args = ap.parse_args()
    got = trimmed(
        asyncio.run(exchanges(args.url.rstrip("/"), args.model) if args.url else launch_and_record())
    )
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / "exchanges.json"
    path.write_text(json.dumps({"vllm": "0.32.0", "exchanges": got}, indent=1) + "\n")
    print(f"{path.relative_to(REPO)}: {len(got)} exchanges")


if __name__ == "__main__":
    main()
