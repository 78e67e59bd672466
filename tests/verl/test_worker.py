"""The adapter the way verl runs it: verl's own AgentLoopWorker loads an `fsm_agent` entry from
agent_loop_config_path, and hydra imports fsm.adapters.verl for the first time while instantiating it. The
entry's spec, limits and tool_policy must hold for every sample of every batch, in a fresh process (where
importing the adapter's module happens inside the worker, as in a real run).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO
from tests.verl.harness import needs_verl

SCRIPT = r"""
import asyncio, json, sys, tempfile
from pathlib import Path

assert "fsm.adapters.verl" not in sys.modules
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from tests.conftest import hermes_text
from tests.verl import harness as h

tmp = Path(tempfile.mkdtemp())
config = h.trainer_config(h.RESPONSE_LENGTH)
config.actor_rollout_ref.model.path = str(h.model_dir())
config.actor_rollout_ref.rollout.agent.agent_loop_config_path = str(
    h.entry_file(tmp, {"max_assistant_turns": 1}, {"validate_arguments": True}))


class Server:  # every turn calls a tool: only the entry's max_assistant_turns ends a trajectory early
    def __init__(self, tok):
        self.replay = lambda: h.ReplayServer([], eos=tok.eos_token_id, prompt_length=h.PROMPT_LENGTH,
                                             response_length=h.RESPONSE_LENGTH,
                                             after=h.encode_turns(tok, [hermes_text([("calculator", {"expression": "1+1"})])])[0])
        self.sessions = {}

    async def generate(self, request_id, **kw):
        return await self.sessions.setdefault(request_id.split("_")[0], self.replay()).generate(request_id, **kw)


async def main():
    worker = AgentLoopWorker(config, llm_client=None)
    worker.llm_client = Server(worker.tokenizer)
    out = []
    for batch in range(3):
        for i in range(4):
            info = {"step": batch, "sample_index": i, "rollout_n": 0, "validate": False}
            res = await worker._run_agent_loop(dict(h.SAMPLING), info, agent_name="fsm_agent", **h.row())
            out.append([batch, res.num_turns, res.extra_fields.get("termination_reason")])
    print(json.dumps(out))

asyncio.run(main())
"""


@needs_verl
def test_the_entry_survives_verl_s_worker_for_every_sample_and_batch():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 12
    assert [(turns, reason) for _, turns, reason in rows] == [(2, "max_assistant_turns")] * 12, rows


QWEN3_SCRIPT = r"""
import asyncio, json, sys, tempfile
from pathlib import Path

from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from tests.conftest import hermes_text
from tests.fixtures.family_tokenizers import family_tokenizer
from tests.verl import harness as h

tmp = Path(tempfile.mkdtemp())
model = tmp / "qwen3"
family_tokenizer("qwen3").save_pretrained(model)  # Qwen3's own chat template on the test vocabulary
(model / "config.json").write_text((h.model_dir() / "config.json").read_text())
config = h.trainer_config(h.RESPONSE_LENGTH, prompt_length=1024)
config.actor_rollout_ref.model.path = str(model)
config.data.apply_chat_template_kwargs = {"enable_thinking": False}
config.actor_rollout_ref.rollout.agent.agent_loop_config_path = str(
    h.entry_file(tmp, {}, None, "specs/family_calculator.yaml"))


async def main():
    worker = AgentLoopWorker(config, llm_client=None)
    tok = worker.tokenizer
    call, answer = h.encode_turns(tok, [hermes_text([("calculator", {"expression": "37 * 12 + 5"})]), "#### 449"])
    worker.llm_client = h.ReplayServer([call, answer], eos=tok.eos_token_id, prompt_length=1024,
                                       response_length=h.RESPONSE_LENGTH)
    info = {"step": 0, "sample_index": 0, "rollout_n": 0, "validate": False}
    res = await worker._run_agent_loop(dict(h.SAMPLING), info, agent_name="fsm_agent", **h.row())
    # the worker's output is padded (prompt on the left, response on the right): decode the tokens only
    prompt, response = res.prompt_ids[0].tolist(), res.response_ids[0].tolist()
    prompt = prompt[len(prompt) - int(res.attention_mask[0, : len(prompt)].sum()):]
    response = response[: int(res.attention_mask[0, len(res.prompt_ids[0]):].sum())]
    text = lambda ids: tok.decode(ids, skip_special_tokens=False)
    print(json.dumps({"prompt": text(prompt), "response": text(response),
                      "turns": res.num_turns, "reason": res.extra_fields.get("termination_reason")}))

asyncio.run(main())
"""


@needs_verl
def test_qwen3_without_thinking_through_verl_s_worker():
    """verl's `data.apply_chat_template_kwargs` (Qwen3's enable_thinking: false) reaches every render of the
    entry's codec: the worker instantiates the entry (it used to fail there: the adapter's own wrapper had no
    len()), the prompt ends in the empty think block and the tool round is rendered by Qwen3's template."""
    proc = subprocess.run(
        [sys.executable, "-c", QWEN3_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), out["prompt"][-200:]
    assert out["reason"] == "done" and out["turns"] == 4, out
    assert (
        "<tool_response>\n449\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n#### 449"
        in out["response"]
    ), out["response"]
