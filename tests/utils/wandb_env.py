"""What the tests against the real W&B client share: a process environment that keeps the
client offline and away from the machine's user, and the client's own reader of a run file."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

# Every wait on the client is bounded.
READ_TIMEOUT = 60.0

_UNSET = ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME")


def isolate(tmp_path, monkeypatch):
    """No network, no console capture, no settings or credentials of the machine's user."""
    for name in _UNSET:
        monkeypatch.delenv(name, raising=False)
    # The client publishes its service's address in this process's environment
    # (WANDB_SERVICE); every child process started later would inherit it and talk to this
    # process's service. Recorded here (set, then removed), monkeypatch removes it again at
    # the test's end whatever the client wrote meanwhile.
    monkeypatch.setenv("WANDB_SERVICE", "unset-by-wandb_env")
    monkeypatch.delenv("WANDB_SERVICE")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb_env_dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_META": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def records(run_dir):
    """The records of the finished run in ``run_dir`` (an ``offline-run-*`` folder), as the
    client's reader prints them (``wandb-core leet inspect --json``: wandb 0.31 has no Python
    reader of the file any more): one JSON object per record. The file is written by the
    client's own process (``wandb-core``), which may still be writing it when ``finish()`` has
    returned: it is read again, for at most ``READ_TIMEOUT`` seconds, until it holds the run's
    exit record (what it holds then is returned either way, for the caller's assertions)."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    from wandb.util import get_core_path

    deadline = time.monotonic() + READ_TIMEOUT
    while True:
        out = subprocess.run(
            [get_core_path(), "leet", "inspect", "--no-observability", "--json"]
            + ["--run-file", str(path), str(Path(run_dir).parent)],
            capture_output=True,
            text=True,
            timeout=READ_TIMEOUT,
            check=True,
        )
        found = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        if any(r["type"] == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)
