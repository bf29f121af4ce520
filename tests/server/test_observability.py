"""What the dashboard and alert rules read is what the server exports (checked against a real
Prometheus by `make observe`; here without one)."""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from fastapi.testclient import TestClient

from engine.interface import DocumentInfo, IngestDone, IngestProgress
from scripts.drills.server import free_port
from server import healthcheck
from server.metrics import IngestionMeter, Metrics
from tests.helpers import TEXT, events_of, fail_on_third_segment, new_session

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC = re.compile(r"\blongdoc_[a-z0-9_]+")


def samples(client) -> dict[str, float]:
    """`name{labels}` -> value, from /metrics."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def sample_names(client) -> set[str]:
    return {key.split("{")[0] for key in samples(client)}


def test_every_metric_the_dashboard_and_alerts_read_is_exported(client):
    session_id = new_session(client, memory="text")
    events_of(client.post(f"/v1/sessions/{session_id}/documents?stream=true", json={"text": TEXT[:3000]}))
    events_of(client.post(f"/v1/sessions/{session_id}/ask", json={"question": "q", "max_tokens": 5, "stream": True}))
    assert client.get("/v1/sessions/nope").status_code == 404
    read = set(METRIC.findall((DEPLOY / "grafana/dashboards/longdoc.json").read_text()))
    read |= set(METRIC.findall((DEPLOY / "prometheus/alerts.yml").read_text()))
    assert len(read) >= 15
    assert sorted(read - sample_names(client)) == []


def test_errors_are_counted_by_type(make_client):
    client = make_client(max_request_bytes=1000)
    session_id = new_session(client, memory="text")
    assert client.get("/v1/sessions/nope").status_code == 404
    assert client.get("/v1/sessions/nope2").status_code == 404
    assert client.post(f"/v1/sessions/{session_id}/ask", json={"question": 7}).status_code == 422
    assert client.post(f"/v1/sessions/{session_id}/ask", json={"question": "x" * 2000}).status_code == 413
    assert client.post(f"/v1/sessions/{session_id}/documents", json={"text": " "}).status_code == 400
    counted = {key: value for key, value in samples(client).items() if key.startswith("longdoc_errors_total")}
    assert counted == {
        'longdoc_errors_total{type="not_found"}': 2.0,
        'longdoc_errors_total{type="validation_error"}': 1.0,
        'longdoc_errors_total{type="too_large"}': 1.0,
        'longdoc_errors_total{type="invalid_request"}': 1.0,
    }


def test_a_failed_streamed_ingestion_is_an_error_event_counted_and_leaves_nothing_pending(client):
    session_id = new_session(client, memory="text")
    fail_on_third_segment(client.app.state.engine.sessions.use(session_id).memory)
    events = events_of(client.post(f"/v1/sessions/{session_id}/documents?stream=true", json={"text": TEXT}))
    assert events[-1].event == "error"
    after = samples(client)
    assert after['longdoc_errors_total{type="internal_error"}'] == 1.0
    assert after['longdoc_ingestion_pending_tokens{memory="text"}'] == 0.0
    assert 0 < after['longdoc_ingested_tokens_total{memory="text"}'] < len(TEXT) / 2


def test_ingestion_meter_counts_tokens_as_they_come_and_clears_what_is_pending():
    metrics = Metrics(lambda: None)
    counted = lambda name: metrics.registry.get_sample_value(name, {"memory": "text"})  # noqa: E731
    meter = IngestionMeter(metrics, "text")
    meter.on_event(IngestProgress("d", 1, 4, 100, 400))
    assert (counted("longdoc_ingested_tokens_total"), counted("longdoc_ingestion_pending_tokens")) == (100, 300)
    meter.on_event(IngestProgress("d", 2, 4, 200, 400))
    meter.close()  # aborted: the rest is no longer waiting
    assert (counted("longdoc_ingested_tokens_total"), counted("longdoc_ingestion_pending_tokens")) == (200, 0)

    meter = IngestionMeter(metrics, "text")
    meter.on_event(IngestProgress("e", 1, 2, 50, 100))
    meter.on_event(IngestDone(DocumentInfo(id="e", name="e", chars=400, tokens=100, segments=2, seconds=0.5)))
    meter.close()
    assert (counted("longdoc_ingested_tokens_total"), counted("longdoc_ingestion_pending_tokens")) == (300, 0)
    assert counted("longdoc_ingestion_tokens_per_second_count") == 1


def test_container_healthcheck_probes_the_port_in_longdoc_port(monkeypatch):
    """The image's HEALTHCHECK (python -m server.healthcheck) follows LONGDOC_PORT, not 8000."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the standard library's name
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("LONGDOC_PORT", str(server.server_address[1]))
        assert healthcheck.main() == 0
        monkeypatch.setenv("LONGDOC_PORT", str(free_port()))
        assert healthcheck.main() == 1
    finally:
        server.shutdown()


def test_an_unhandled_exception_is_counted_as_a_500_and_an_internal_error(client, monkeypatch):
    def broken():
        raise RuntimeError("bug")

    monkeypatch.setattr(client.app.state.engine, "list_models", broken)
    plain = TestClient(client.app, raise_server_exceptions=False)  # the app is already started by `client`
    response = plain.get("/v1/models")
    assert response.status_code == 500 and response.json()["error"]["type"] == "internal_error"
    after = samples(client)
    assert after['longdoc_requests_total{method="GET",route="/v1/models",status="500"}'] == 1.0
    assert after['longdoc_errors_total{type="internal_error"}'] == 1.0
