"""A command harness that leaves two grandchildren behind, both ignoring SIGTERM: one in its process group, one in a
session of its own (setsid). It makes one model call, starts them, waits until both have written their pid into
$ORPHANS_DIR, and exits 0 (or, with $ORPHANS_HANG set, sleeps until its row ends it). Each grandchild then waits for the harness to exit, calls the session, and writes the
HTTP status it got (tests/gateway/test_hostile.py)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

OUT = os.environ["ORPHANS_DIR"]


def call(messages: list) -> int:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": messages}).encode(),
        headers={
            "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
            "Content-Type": "application/json",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def grandchild(name: str, harness: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(OUT, f"{name}.pid"), "w") as f:
        f.write(str(os.getpid()))
    while running(harness):
        time.sleep(0.001)
    status = call([{"role": "user", "content": "a call after the harness exited"}])
    # written whole or not at all: the row's end may SIGKILL this process between an open and its write
    with open(os.path.join(OUT, f"{name}.status.part"), "w") as f:
        f.write(str(status))
    os.replace(os.path.join(OUT, f"{name}.status.part"), os.path.join(OUT, f"{name}.status"))
    time.sleep(600)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        grandchild(sys.argv[1], int(sys.argv[2]))
        sys.exit(0)
    call(json.loads(os.environ["AGENTFSM_ROW"])["raw_prompt"])
    for name, own_session in (("group", False), ("setsid", True)):
        subprocess.Popen(
            [sys.executable, __file__, name, str(os.getpid())],
            start_new_session=own_session,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + 30
    while not all(os.path.exists(os.path.join(OUT, f"{n}.pid")) for n in ("group", "setsid")):
        assert time.monotonic() < deadline, "the grandchildren did not start"
        time.sleep(0.001)
    if os.environ.get("ORPHANS_HANG"):  # the row ends first (the harness's timeout)
        time.sleep(600)
