"""End to end on SmolLM2-135M, the small model: a server subprocess on a free loopback port, a 39k-token
public-domain book ingested in text mode, a question about its middle answered by REST streaming,
the openai SDK, and the `longdoc` command line (on the chapter the question is about); a session in the default memory answering about a
132K-token book; and a pass key answered from a Neurocache session with the shipped adapter."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from clients.client import LongdocClient
from engine.config import SMALL_MODEL
from scripts.drills.server import free_port
from tests.helpers import CACHE_DIR, FIXTURES, greedy

BOOK = FIXTURES / "alice29.txt"
LOG = Path("test-artifacts/e2e-server.log")
# The Dormouse's story in chapter VII, about 55% of the way through the book.
QUESTION = "What were the names of the three little sisters in the Dormouse's story?"
ANSWER_NAMES = ("Elsie", "Lacie", "Tillie")


def names_the_sisters(answer: str) -> bool:
    """Two of the three names at least: with hybrid retrieval SmolLM2-135M writes "Elsie,
    Lacie, and" and then strays, though its excerpts hold all three (checked below)."""
    return sum(name in answer for name in ANSWER_NAMES) >= 2


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_dir):
    port = free_port()
    env = {
        **os.environ,
        "LONGDOC_CACHE_DIR": str(CACHE_DIR),
        "LONGDOC_DATA_DIR": tempfile.mkdtemp(prefix="longdoc-sessions-"),
        "LONGDOC_API_KEY": "e2e-key",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "clients.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--model",
        SMALL_MODEL,
        "--model",
        "cacheformer-bytes",
    ]
    LOG.parent.mkdir(exist_ok=True)
    with LOG.open("w") as log:  # kept after the run: a 500's traceback is in it
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None, LOG.read_text()
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(0.5)
    yield url
    process.terminate()
    process.wait(timeout=30)
    assert "e2e-key" not in LOG.read_text()  # the secret never reaches the logs


@pytest.fixture(scope="module")
def session(server):
    client = LongdocClient(server, api_key="e2e-key")
    session_id = client.create_session(memory="text")["id"]
    events = list(client.add_document_stream(session_id, BOOK.read_text(encoding="utf-8"), name="alice"))
    assert events[-1].event == "done", events[-1]
    assert events[-1].data["tokens"] > 20_000
    return session_id


@pytest.fixture(scope="module")
def first_events(server, session):
    """The server's first answer (engine/runtime/registry.py's `warm_up` is why it is not different)."""
    return list(LongdocClient(server, api_key="e2e-key").ask_stream(session, QUESTION, max_tokens=48))


def test_streamed_answer_about_the_middle_of_the_book(first_events):
    assert first_events[0].event == "retrieval"
    deltas = [e.data["text"] for e in first_events if e.event == "delta"]
    assert len(deltas) > 3  # it really streamed, token by token
    answer = "".join(deltas)
    assert names_the_sisters(answer), answer
    book = BOOK.read_text(encoding="utf-8")
    spans = [book[i["char_start"] : i["char_end"]] for i in first_events[0].data["items"]]
    assert any(all(name in span for name in ANSWER_NAMES) for span in spans)
    assert first_events[-1].event == "done" and first_events[-1].data["timings"]["ttft_seconds"] > 0


def test_openai_sdk_streams_the_answer(server, session, first_events):
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=f"{server}/v1", api_key="e2e-key")
    stream = sdk.chat.completions.create(
        model=SMALL_MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"session_id": session},
    )
    answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert names_the_sisters(answer), answer
    assert answer == "".join(e.data["text"] for e in first_events if e.event == "delta")  # greedy: the server's first answer


def test_metrics_show_the_traffic(server, session):
    LongdocClient(server, api_key="e2e-key").ask(session, QUESTION, max_tokens=8)
    text = httpx.get(f"{server}/metrics").text
    assert 'longdoc_time_to_first_token_seconds_count{endpoint="ask"}' in text
    assert 'longdoc_ingested_tokens_total{memory="text"}' in text


def test_command_line_ingest_and_ask(server, tmp_path: Path):
    env = {**os.environ, "LONGDOC_URL": server, "LONGDOC_API_KEY": "e2e-key"}
    cli = [sys.executable, "-m", "clients.cli"]
    book = BOOK.read_text(encoding="utf-8")
    chapter = tmp_path / BOOK.name  # the chapter the question is about: the `session` fixture has the whole book
    chapter.write_text(book[book.index("CHAPTER VII") : book.index("CHAPTER VIII")], encoding="utf-8")
    ingested = subprocess.run(
        [*cli, "ingest", str(chapter), "--memory", "text"], env=env, capture_output=True, text=True, timeout=300
    )
    assert ingested.returncode == 0, ingested.stderr
    session_id = ingested.stdout.split()[1].rstrip(":")
    answer = subprocess.run(
        [*cli, "ask", QUESTION, "--session", session_id, "--max-tokens", "48"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert answer.returncode == 0, answer.stderr
    assert names_the_sisters(answer.stdout), answer.stdout
    listed = subprocess.run([*cli, "sessions"], env=env, capture_output=True, text=True, timeout=60)
    assert session_id in listed.stdout and "alice29.txt" in listed.stdout
    missing = subprocess.run([*cli, "ask", "q", "--session", "s-missing"], env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "not_found" in missing.stderr


def test_a_default_session_answers_about_a_130k_token_book_by_rest_and_the_openai_sdk(server):
    """A session made without `memory` gets SmolLM2-135M's measured default (its manifest),
    and answers a question about the middle of Paradise Lost (132K tokens)."""
    from research.training.corpus import fetch

    book = (fetch() / "plrabn12.txt").read_text(encoding="utf-8")
    client = LongdocClient(server, api_key="e2e-key")
    session_id = client.create_session()["id"]
    assert client.session(session_id)["memory"] == "text"
    document = client.add_document(session_id, book, name="paradise-lost")
    assert document["tokens"] > 100_000 and document["warning"] is None
    question = "Which angel did Heaven's King send to converse with Adam and warn him?"
    answer = client.ask(session_id, question, max_tokens=48)["answer"]
    assert "Raphael" in answer
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=f"{server}/v1", api_key="e2e-key")
    reply = sdk.chat.completions.create(  # no temperature, as the README's example: the manifest's greedy
        model=SMALL_MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=48,
        seed=1,
        extra_body={"session_id": session_id},
    )
    assert reply.choices[0].message.content == answer  # greedy both ways
    client.delete_session(session_id)


def test_a_neurocache_session_answers_a_pass_key_from_its_cache(server, tmp_path: Path):
    """A neurocache prompt holds no document text, so only the cache can supply the key (stated
    374 tokens into a 2,358-token document)."""
    filler = BOOK.read_text(encoding="utf-8")[:9000]
    key = "60917"
    document = tmp_path / "passkey.txt"
    document.write_text(f"{filler[:1500]} The pass key is {key}. Remember it. {key} is the pass key. {filler[1500:]}")
    client = LongdocClient(server, api_key="e2e-key")
    session_id = client.create_session(model=SMALL_MODEL, memory="neurocache")["id"]
    events = list(client.add_document_stream(session_id, document.read_text(), name="passkey.txt"))
    assert events[-1].event == "done", events[-1]
    answer = client.ask(session_id, "What is the pass key? Answer with the number.", max_tokens=16)
    assert key in answer["answer"], answer


def _queue_depth(server: str) -> float:
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith(f'longdoc_queue_depth{{worker="model:{SMALL_MODEL}"}}'):
            return float(line.split()[-1])
    raise AssertionError("no queue depth gauge for SmolLM2-135M")


def test_client_disconnect_cancels_generation(server, session):
    body = {"question": "Retell the whole book in great detail.", "max_tokens": 1000, "stream": True}
    headers = {"Authorization": "Bearer e2e-key"}
    with httpx.stream("POST", f"{server}/v1/sessions/{session}/ask", json=body, headers=headers, timeout=60) as response:
        deltas = 0
        for line in response.iter_lines():
            deltas += line == "event: delta"
            if deltas == 3:
                break  # hang up mid-answer
    # 1000 tokens take tens of seconds on this model; a cancelled request frees its slot at once
    deadline = time.monotonic() + 10
    while _queue_depth(server) != 0:
        assert time.monotonic() < deadline, "generation went on after the client left"
        time.sleep(0.2)


async def test_async_client_streams_the_same_answer(server, session):
    from clients.client import AsyncLongdocClient

    client = AsyncLongdocClient(server, api_key="e2e-key")
    try:
        names = [e.event async for e in client.ask_stream(session, QUESTION, max_tokens=48)]
        plain = await client.ask(session, QUESTION, max_tokens=48)
        info = await client.session(session)
    finally:
        await client.aclose()
    assert names[0] == "retrieval" and names[-1] == "done" and names.count("delta") > 3
    assert names_the_sisters(plain["answer"]), plain["answer"]
    assert info["documents"][0]["name"] == "alice"


def test_cli_asks_the_shipped_cacheformer_through_the_server(server, tmp_path):
    """`longdoc ingest` and `longdoc ask` on the shipped CacheFormer checkpoint: the streamed answer
    is the model's greedy continuation after the whole document, computed here directly."""
    from research.lms.lm_io import load_checkpoint
    from research.plugin import SHIPPED_CHECKPOINTS

    text = BOOK.read_text(encoding="utf-8")[:5000]  # ten times the model's 512-byte training length
    (tmp_path / "alice.txt").write_text(text, encoding="utf-8")
    env = {**os.environ, "LONGDOC_URL": server, "LONGDOC_API_KEY": "e2e-key"}
    cli = [sys.executable, "-m", "clients.cli"]
    ingested = subprocess.run(
        [*cli, "ingest", str(tmp_path / "alice.txt"), "--model", "cacheformer-bytes"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ingested.returncode == 0, ingested.stderr
    session_id = ingested.stdout.split()[1].rstrip(":")
    assert LongdocClient(server, api_key="e2e-key").session(session_id)["memory"] == "state"
    asked = subprocess.run(
        [*cli, "ask", "Alice was", "--session", session_id, "--max-tokens", "24"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert asked.returncode == 0, asked.stderr
    expected = greedy(load_checkpoint(SHIPPED_CHECKPOINTS / "cacheformer-bytes"), text, "Alice was", 24)
    assert asked.stdout.rstrip("\n") == expected.rstrip("\n") and expected.strip()


def _metric(server: str, series: str) -> float:
    for line in httpx.get(f"{server}/metrics", timeout=10).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {series} on /metrics")


def test_client_disconnect_during_ingestion_leaves_no_tokens_pending(server):
    headers = {"Authorization": "Bearer e2e-key"}
    session_id = httpx.post(f"{server}/v1/sessions", json={"memory": "text"}, headers=headers, timeout=30).json()["id"]
    url = f"{server}/v1/sessions/{session_id}/documents?stream=true"
    text = BOOK.read_text(encoding="utf-8")
    with httpx.stream("POST", url, json={"text": text}, headers=headers, timeout=60) as response:
        for line in response.iter_lines():
            if line == "event: progress":
                break  # hang up after the first segment
    pending = 'longdoc_ingestion_pending_tokens{memory="text"}'
    deadline = time.monotonic() + 20
    while _metric(server, pending) != 0:
        assert time.monotonic() < deadline, "tokens of an abandoned document stay pending"
        time.sleep(0.2)
    documents = httpx.get(f"{server}/v1/sessions/{session_id}", headers=headers, timeout=30).json()["documents"]
    assert documents == []  # the abandoned document was not kept
    httpx.delete(f"{server}/v1/sessions/{session_id}", headers=headers, timeout=30)
