"""Schemathesis against the server's own /openapi.json: every operation, bounded examples, the
check that matters here being `not_a_server_error` (no 5xx, whatever the input)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from scripts.drills.server import Server

SCHEMATHESIS = Path(__file__).resolve().parents[2] / ".venv-drills" / "bin" / "schemathesis"


def run_fuzz(server: Server, *, max_examples: int, max_time: int, seed: int = 0) -> dict:
    cmd = [
        str(SCHEMATHESIS),
        "run",
        f"{server.url}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(max_examples),
        "--max-time",
        str(max_time),
        "--seed",
        str(seed),
        "--workers",
        "2",
        "--request-timeout",
        "300",
        "--generation-database",
        "none",
        "--no-color",
        "--suppress-health-check",
        "all",
    ]
    started = time.perf_counter()
    completed = subprocess.run(cmd, capture_output=True, text=True)
    output = completed.stdout + completed.stderr
    summary = [
        line.strip()
        for line in output.splitlines()
        if re.match(r"\s*(Test cases|API Operations|Test Phases|Failures|Errors|Seed)\b", line)
    ]
    cases = re.search(r"Test cases:\s*(\d+) generated", output)
    return {
        "exit_code": completed.returncode,
        "cases": int(cases.group(1)) if cases else None,
        "summary": summary,
        "tail": output[-3000:],
        "alive": server.alive(),
        "seconds": round(time.perf_counter() - started, 1),
    }


def fuzz_passed(result: dict) -> bool:
    return result["exit_code"] == 0 and result["alive"]
