"""`make observe`: the shipped dashboard and alert rules checked against a real Prometheus.

    python -m scripts.observe [--keep] [--ray]

Starts `longdoc serve` (with one unreadable session snapshot planted in its data folder) and a real
Prometheus scraping it every second with deploy/prometheus/alerts.yml loaded, drives traffic in two
rounds (sessions of two memories, documents, answers streamed and not, chat completions, bad
requests), then runs every query of deploy/grafana/dashboards/longdoc.json against Prometheus's HTTP
API. Each query must return data (a result that is all NaN counts as none). Every alert rule must
evaluate without error; the snapshot alert must fire and the others must stay quiet on this healthy
server. Prints one line per query and per rule; exits non-zero if any check failed.

With --ray the server is `longdoc serve-ray` with 2 replicas: Prometheus finds each replica's own
/metrics through the targets folder the replicas write (file_sd), must scrape both, and the same
dashboard queries (which sum over replicas) must return data.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from scripts.drills.server import Server, free_port, wait_until_up

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "longdoc.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
BOOK = ROOT / "tests" / "fixtures" / "alice29.txt"
FIRING_HERE = {"LongdocUnreadableSnapshots"}  # the planted snapshot; every other alert must be quiet
SERVER_ARGS = ["--max-new-tokens", "24", "--default-max-tokens", "12"]
QUESTION = "What did the White Rabbit take out of its waistcoat-pocket?"


def plant_unreadable_snapshot(data_dir: Path) -> None:
    """A session folder of another format version: the server must report it and go on."""
    folder = data_dir / "unreadable-0"
    folder.mkdir(parents=True)
    (folder / "session.json").write_text(json.dumps({"format": "longdoc-session-v0"}))


def start_prometheus(targets: dict, folder: Path) -> tuple[subprocess.Popen, str]:
    """`targets`: a scrape config's `static_configs` or `file_sd_configs` entry."""
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "longdoc", **targets}],
    }
    (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    cmd = [
        "prometheus",
        f"--config.file={folder / 'prometheus.yml'}",
        f"--storage.tsdb.path={folder / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    log = folder / "prometheus.log"
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(process, f"{url}/-/ready", "prometheus", log, 60)
    return process, url


def drive(url: str, document: str) -> None:
    """One round of traffic: what a user does, and what a careless client does."""
    with httpx.Client(base_url=url, timeout=300) as client:
        for memory in ("text", "truncate"):
            session = client.post("/v1/sessions", json={"memory": memory}).raise_for_status().json()["id"]
            with client.stream("POST", f"/v1/sessions/{session}/documents?stream=true", json={"text": document}) as r:
                r.raise_for_status()
                r.read()
            client.post(f"/v1/sessions/{session}/ask", json={"question": QUESTION}).raise_for_status()
            with client.stream("POST", f"/v1/sessions/{session}/ask", json={"question": QUESTION, "stream": True}) as r:
                r.raise_for_status()
                r.read()
            chat = {"session_id": session, "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}]}
            with client.stream("POST", "/v1/chat/completions", json=chat) as r:
                r.raise_for_status()
                r.read()
        got = [
            client.get("/v1/sessions/no-such-session").status_code,
            client.post(f"/v1/sessions/{session}/ask", json={"question": 7}).status_code,
            client.post(f"/v1/sessions/{session}/documents", json={"text": "   "}).status_code,
        ]
        if got != [404, 422, 400]:
            raise RuntimeError(f"bad requests answered {got}, expected [404, 422, 400]")


def query(prometheus: str, expr: str) -> list[dict]:
    body = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).raise_for_status().json()
    return body["data"]["result"]


def has_data(result: list[dict]) -> bool:
    return any(not math.isnan(float(series["value"][1])) for series in result)


def check_dashboard(prometheus: str) -> list[tuple[bool, str]]:
    lines = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            result = query(prometheus, target["expr"])
            values = ", ".join(f"{float(s['value'][1]):.4g}" for s in result[:4])
            lines.append((has_data(result), f"{panel['title']} / {target['legendFormat']}: {len(result)} series [{values}]"))
    return lines


def check_replicas(prometheus: str, count: int) -> list[tuple[bool, str]]:
    result = query(prometheus, 'up{job="longdoc"} == 1')
    replicas = sorted(series["metric"].get("replica", "-") for series in result)
    return [(len(replicas) == count, f"replicas scraped: {len(replicas)} of {count} {replicas}")]


def check_rules(prometheus: str) -> list[tuple[bool, str]]:
    """Every rule evaluated without error; the alerts firing are exactly the expected ones."""
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).raise_for_status().json()["data"]["groups"]
    lines = []
    for rule in (rule for group in groups for rule in group["rules"]):
        states = {alert["state"] for alert in rule.get("alerts", [])}
        firing = "firing" in states
        ok = rule["health"] == "ok" and firing == (rule["name"] in FIRING_HERE)
        lines.append((ok, f"alert {rule['name']}: health {rule['health']}, state {rule.get('state', '-')}"))
    return lines


def wait_for(check, seconds: float) -> list[tuple[bool, str]]:
    """Poll until every line passes or time is up (scrapes and rule evaluations run every second)."""
    deadline = time.monotonic() + seconds
    while True:
        lines = check()
        if all(ok for ok, _ in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="leave both running until Ctrl-C (to look at them)")
    parser.add_argument("--ray", action="store_true", help="longdoc serve-ray, 2 replicas, found by file_sd")
    args = parser.parse_args()
    if shutil.which("prometheus") is None:
        print("prometheus is not installed: `make observe` installs Debian's package", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="longdoc-observe-"))
    if args.ray:
        ray_args = ["--replicas", "2", "--metrics-targets-dir", str(folder / "targets")]
        server = Server([*SERVER_ARGS, *ray_args], command="serve-ray", log=folder / "server.log")
        targets: dict = {"file_sd_configs": [{"files": [str(folder / "targets" / "*.json")], "refresh_interval": "1s"}]}
    else:
        server = Server(SERVER_ARGS, log=folder / "server.log")
        targets = {"static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}
    plant_unreadable_snapshot(server.data_dir)
    prometheus, failed = None, 1
    try:
        server.start()
        prometheus, prom_url = start_prometheus(targets, folder)
        document = BOOK.read_text(encoding="utf-8")[:12_000]
        for _ in range(2):  # rates need samples before and after the traffic
            drive(server.url, document)
            time.sleep(3)
        lines = wait_for(lambda: check_dashboard(prom_url), 30) + wait_for(lambda: check_rules(prom_url), 30)
        if args.ray:
            lines += wait_for(lambda: check_replicas(prom_url, 2), 30)
        for ok, line in lines:
            print(f"{'ok  ' if ok else 'FAIL'} {line}")
        failed = sum(not ok for ok, _ in lines)
        print(f"{len(lines) - failed}/{len(lines)} checks passed (Prometheus {prom_url}, longdoc {server.url})")
        if args.keep:
            print("running until Ctrl-C")
            while True:
                time.sleep(3600)
        return 1 if failed else 0
    except KeyboardInterrupt:
        return 0
    finally:
        for process in (prometheus, server.process):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
        shutil.rmtree(server.data_dir, ignore_errors=True)
        if failed:
            print(f"logs kept in {folder}", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
