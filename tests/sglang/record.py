"""Record real SGLang's answers to every scenario of tests/sglang/scenarios.py into tests/fixtures/sglang/.

    python -m tests.sglang.record                     # launches SGLang from .venv-sglang ($SGLANG_VENV), CPU
    python -m tests.sglang.record --url URL           # a server already serving backends/tiny/assets
    python -m tests.sglang.record --only aborts       # one scenario

Re-run it when SGLang changes (after `bash .ci/sglang_env.sh` with a new pin); tests/test_devserver_fidelity.py
then says where the dev server no longer answers as SGLang does. Scenarios change the server's state and
put it back (weights end on backends/tiny/assets), so a launched server is fresh and a given one must be
serving the tiny model at version "default" to record the same fixtures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from tests.sglang.scenarios import SCENARIOS, run_scenario

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "backends" / "tiny" / "assets"
FIXTURES = REPO / "tests" / "fixtures" / "sglang"


async def record(url: str, only: list[str]) -> None:

    version = None
    for name in only or list(SCENARIOS):
        exchanges = await run_scenario(name, url, str(ASSETS))
        if version is None:
            info = await run_scenario("info", url, str(ASSETS))
            version = next(e["body"]["version"] for e in info if e["name"] == "server_info")
        FIXTURES.mkdir(parents=True, exist_ok=True)
        path = FIXTURES / f"{name}.json"
        path.write_text(
            json.dumps({"sglang": version, "scenario": name, "exchanges": exchanges}, indent=1) + "\n"
        )
        print(f"{path.relative_to(REPO)}: {len(exchanges)} exchanges")


async def launch_and_record(only: list[str]) -> None:
    import tempfile

    from backends.launcher import SGLangLauncher
    from tests.sglang.conftest import PYTHON, READY_S, free_port

    with tempfile.TemporaryDirectory() as logs:
        async with SGLangLauncher(
            str(ASSETS),
            base_port=free_port(),
            device="cpu",
            python=str(PYTHON),
            log_dir=logs,
            startup_timeout_s=READY_S,
        ) as launcher:
            await record(launcher.urls[0], only)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running SGLang server (default: launch one)")
    ap.add_argument(
        "--only", action="append", choices=sorted(SCENARIOS), default=[], help="scenario(s) to record"
    )
    args = ap.parse_args()
    asyncio.run(record(args.url, args.only) if args.url else launch_and_record(args.only))


if __name__ == "__main__":
    main()
