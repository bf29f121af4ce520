"""Peers in one run, on this machine and this model: longdoc's server, llama-cpp-python's server
(on the GGUF file longdoc's model is converted from) and plain transformers `generate`.

    make peers   # builds llama-cpp-python[server] in .venv-peers, then runs this:
    .venv/bin/python -m bench.peers --peers-python .venv-peers/bin/python --quantize none bf16 int8
    .venv/bin/python -m bench.peers --model qwen2.5-coder-1.5b-instruct   # the default model (a split GGUF, joined)

longdoc is measured once per `--quantize` mode given (a server each, one after the other).
`--alternate N` measures only one-stream decode after a 512-token prompt, with every server up at
once and their requests taken in turns (each round in the other order), N rounds: on a machine whose speed drifts (a VM's
neighbours), the ratios of one run of the full table can move by a third, and turns share the drift.

Per system: prefill tok/s for prompts of about 512, 2K and 8K tokens (prompt tokens / time to the
first token), decode tok/s of one stream after a 512- and a 2K-token prompt, and, through each
server's OpenAI-compatible HTTP API, with 1, 4 and 8 streams at once (512-token prompts): all
output tokens / wall time (prefills included), decode tok/s in all while every stream decodes
(the tokens streamed between the last stream's first token and the first stream's end, over
that window) and the median TTFT. Each figure is the median of `--repeats` runs (prefill at 8K
tokens: one run). Greedy, 64 new tokens; an answer may end earlier at the end token, and the
rates count the tokens produced (the output text tokenized again with the model's tokenizer).
Every request reads its own stretch of the book, so no server reuses a cached prompt prefix.
longdoc and transformers run the dequantized weights (float32 on a CPU without fast bfloat16);
llama.cpp runs the GGUF's quantized weights as they are (SmolLM2's Q4_1, Qwen's Q4_K_M).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import httpx
import torch
from transformers import PreTrainedTokenizerBase

from engine.config import DEFAULT_CACHE_DIR, SMALL_MODEL
from engine.models.loader import load_model
from engine.models.wheels import WHEEL_MODELS, join_parts, part_paths
from scripts.drills import streams
from scripts.drills.server import Server, free_port, wait_until_up

BOOK = Path("tests/fixtures/alice29.txt")  # 41K tokens: every request below reads its own stretch
NEW_TOKENS = 64
PROMPTS = (512, 2048, 8000)  # 8K: what fits 8,192 positions with the answer
DECODE_CONTEXTS = (512, 2048)
STREAMS = (1, 4, 8)
INSTRUCTION = "\n\nContinue this text."


@dataclass
class Prompts:
    """Chat prompts of a given length in tokens, each from its own stretch of the book."""

    tokenizer: PreTrainedTokenizerBase
    book_ids: list[int]
    next_at: int = 0

    def make(self, tokens: int) -> str:
        body = tokens - 40  # the chat template and the instruction
        if self.next_at + body > len(self.book_ids):
            self.next_at = 0
        text = str(self.tokenizer.decode(self.book_ids[self.next_at : self.next_at + body]))
        self.next_at += body
        return text + INSTRUCTION


@dataclass
class Answer:
    """One streamed chat completion: when each content delta came (perf_counter seconds)."""

    started: float
    times: list[float]
    text: str

    @property
    def ttft(self) -> float:
        return self.times[0] - self.started

    @property
    def total(self) -> float:
        return self.times[-1] - self.started


def stream_chat(url: str, model: str, content: str) -> Answer:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    times, parts = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line.removeprefix("data: "))["choices"]
            delta = choices[0]["delta"].get("content") if choices else None
            if delta:
                times.append(time.perf_counter())
                parts.append(delta)
    assert times, "no content streamed"
    return Answer(started, times, "".join(parts))


@dataclass
class Measures:
    prefill: dict[int, float]  # prompt tokens -> tok/s
    decode: dict[int, float]  # context tokens -> tok/s
    streams: dict[int, float]  # streams at once -> output tok/s in all
    streams_decode: dict[int, float] = field(default_factory=dict)  # streams at once -> decode tok/s in all
    streams_ttft: dict[int, float] = field(default_factory=dict)  # streams at once -> median TTFT, s


def decode_while_all(answers: list[Answer], count_tokens: Callable[[str], int]) -> float | None:
    """Tokens streamed per second, all answers together, while every one of them was decoding
    (scripts/drills/streams.py)."""
    return streams.decode_while_all([(a.times, count_tokens(a.text)) for a in answers])


def http_measures(url: str, model: str, prompts: Prompts, count_tokens: Callable[[str], int], repeats: int) -> Measures:
    stream_chat(url, model, prompts.make(128))  # warm-up
    prefill, decode = {}, {}
    for tokens in PROMPTS:
        runs = 1 if tokens > 2048 else repeats
        prefill[tokens] = median(tokens / stream_chat(url, model, prompts.make(tokens)).ttft for _ in range(runs))
    for tokens in DECODE_CONTEXTS:
        answers = [stream_chat(url, model, prompts.make(tokens)) for _ in range(repeats)]
        decode[tokens] = median((count_tokens(a.text) - 1) / (a.total - a.ttft) for a in answers)
    measures = Measures(prefill, decode, {})
    for count in STREAMS:
        totals, decodes, ttfts = [], [], []
        for _ in range(repeats):
            contents = [prompts.make(512) for _ in range(count)]
            started = time.perf_counter()
            with ThreadPoolExecutor(count) as pool:
                answers = list(pool.map(lambda c: stream_chat(url, model, c), contents))
            totals.append(sum(count_tokens(a.text) for a in answers) / (time.perf_counter() - started))
            decodes.append(decode_while_all(answers, count_tokens))
            ttfts.append(median(a.ttft for a in answers))
        measures.streams[count] = median(totals)
        measures.streams_ttft[count] = median(ttfts)
        found = [d for d in decodes if d is not None]
        if found:
            measures.streams_decode[count] = median(found)
    return measures


def transformers_measures(model, tokenizer, prompts: Prompts, repeats: int) -> Measures:
    """Plain `generate` in this process: no server, no batching, one request at a time."""

    def ids_of(tokens: int) -> torch.Tensor:
        messages = [{"role": "user", "content": prompts.make(tokens)}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]

    def generate(ids: torch.Tensor, new: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        return time.perf_counter() - started

    generate(ids_of(128), 2)  # warm-up
    prefill = {}
    for tokens in PROMPTS:
        runs = 1 if tokens > 2048 else repeats
        prefill[tokens] = median(len(ids[0]) / generate(ids, 1) for ids in (ids_of(tokens) for _ in range(runs)))
    decode = {}
    for tokens in DECODE_CONTEXTS:
        rates = []
        for _ in range(repeats):
            ids = ids_of(tokens)
            first = generate(ids, 1)
            rates.append((NEW_TOKENS - 1) / (generate(ids, NEW_TOKENS) - first))
        decode[tokens] = median(rates)
    return Measures(prefill, decode, {})


def gguf_file(name: str, scratch: Path) -> Path:
    """The model's GGUF: its one installed file, or its parts joined into `scratch` (digest checked)."""
    parts, spec = part_paths(name), WHEEL_MODELS[name]
    if spec.sha256 is None:  # one wheel, pinned by its version (as the loader decides)
        return parts[0]
    return join_parts(parts, scratch / spec.gguf, spec.sha256)


def llama_server(python: str, gguf: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = Path("/tmp/longdoc-peers-llama.log")
    cmd = [
        python,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--n_threads",
        "2",
        "--n_ctx",
        "8192",
        "--interrupt_requests",
        "False",
        "--port",
        str(port),
    ]
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(process, f"{url}/v1/models", "llama_cpp.server", log, 300)
    return process, url


def measure(kind: str, key: int) -> Callable[[Measures], float | None]:
    """Reads one figure of a system's measures (None where the system does not have it)."""

    def pick(measures: Measures) -> float | None:
        figures: dict[int, float] = getattr(measures, kind)
        return figures.get(key)

    return pick


def longdoc_name(quantize: str) -> str:
    return {"auto": "longdoc (default)", "none": "longdoc --quantize none"}.get(quantize, f"longdoc --quantize {quantize}")


def table(results: dict[str, Measures]) -> str:
    names = list(results)
    ours = [name for name in names if name.startswith("longdoc")]
    lines = [
        "| measure | " + " | ".join(names) + " | " + " | ".join(f"{name} / llama.cpp" for name in ours) + " |",
        "|---|" + "---|" * (len(names) + len(ours)),
    ]

    def row(label: str, pick: Callable[[Measures], float | None]) -> None:
        values = [pick(results[name]) for name in names]
        cells = [f"{v:,.2f}" if v is not None and v < 10 else f"{v:,.1f}" if v is not None else "—" for v in values]
        theirs = pick(results["llama.cpp"])
        ratios = [pick(results[name]) for name in ours]
        cells += [f"{r / theirs:.2f}x" if r and theirs else "—" for r in ratios]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for tokens in PROMPTS:
        row(f"prefill tok/s, {tokens:,}-token prompt", measure("prefill", tokens))
    for tokens in DECODE_CONTEXTS:
        row(f"decode tok/s, one stream, {tokens:,}-token context", measure("decode", tokens))
    for count in STREAMS:
        at_once = f"{count} stream{'s' if count > 1 else ''} at once (HTTP)"
        row(f"output tok/s in all, {at_once}", measure("streams", count))
        row(f"decode tok/s in all while all decode, {at_once}", measure("streams_decode", count))
        row(f"median TTFT s, {at_once}", measure("streams_ttft", count))
    return "\n".join(lines)


def alternate(args: argparse.Namespace, prompts: Prompts, count_tokens: Callable[[str], int]) -> None:
    """One-stream decode after 512-token prompts, the servers' requests in turns (`--alternate`)."""
    servers = {
        longdoc_name(q): Server(
            ["--model", args.model, "--device", "cpu", "--quantize", q], log=Path(f"/tmp/longdoc-peers-{q}.log")
        )
        for q in args.quantize
    }
    rates: dict[str, list[float]] = {name: [] for name in [*servers, "llama.cpp"]}
    with tempfile.TemporaryDirectory(prefix="longdoc-peers-") as scratch:
        process, llama_url = llama_server(args.peers_python, gguf_file(args.model, Path(scratch)))
        try:
            urls = {name: server.start().url for name, server in servers.items()} | {"llama.cpp": llama_url}
            for url in urls.values():
                stream_chat(url, args.model, prompts.make(128))  # warm-up
            for round_ in range(args.alternate):
                order = list(urls.items())
                for name, url in order if round_ % 2 == 0 else order[::-1]:  # each goes first in turn
                    answer = stream_chat(url, args.model, prompts.make(512))
                    rates[name].append((count_tokens(answer.text) - 1) / (answer.total - answer.ttft))
                print(f"round {round_ + 1}:", {name: round(r[-1], 2) for name, r in rates.items()}, flush=True)
        finally:
            process.kill()
            for server in servers.values():
                if server.process is not None:  # started
                    server.stop()
    theirs = median(rates["llama.cpp"])
    print(f"\ndecode tok/s, one stream, 512-token context, medians of {args.alternate} rounds in turns; `{' '.join(sys.argv)}`\n")
    print("| system | decode tok/s | / llama.cpp |\n|---|---|---|")
    for name, found in rates.items():
        print(f"| {name} | {median(found):.2f} | {median(found) / theirs:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-python", default=".venv-peers/bin/python", help="a Python with llama-cpp-python[server]")
    parser.add_argument(
        "--quantize", nargs="+", default=["auto", "none"], help="longdoc serve --quantize modes to measure (auto: the default)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measure; the median is reported")
    parser.add_argument("--model", default=SMALL_MODEL, choices=list(WHEEL_MODELS), help="a model from PyPI wheels")
    parser.add_argument("--alternate", type=int, default=0, help="only one-stream decode, the servers in turns, this many rounds")
    args = parser.parse_args()
    if args.alternate < 0:
        parser.error("--alternate takes a number of rounds, at least 1")
    model = args.model
    loaded = load_model(model, cache_dir=DEFAULT_CACHE_DIR, device="cpu")
    tokenizer = loaded.tokenizer
    book_ids = tokenizer(BOOK.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    print(f"torch threads {torch.get_num_threads()}, {model} as {loaded.dtype}", flush=True)
    if args.alternate:
        alternate(args, Prompts(tokenizer, book_ids), count_tokens)
        return
    results: dict[str, Measures] = {}
    for quantize in args.quantize:
        server = Server(["--model", model, "--device", "cpu", "--quantize", quantize]).start()
        try:
            results[longdoc_name(quantize)] = http_measures(
                server.url, model, Prompts(tokenizer, book_ids), count_tokens, args.repeats
            )
        finally:
            server.stop()
        print(f"{longdoc_name(quantize)}:", results[longdoc_name(quantize)], flush=True)
    with tempfile.TemporaryDirectory(prefix="longdoc-peers-") as scratch:
        process, url = llama_server(args.peers_python, gguf_file(model, Path(scratch)))
        try:
            results["llama.cpp"] = http_measures(url, model, Prompts(tokenizer, book_ids), count_tokens, args.repeats)
        finally:
            process.kill()
    print("llama.cpp:", results["llama.cpp"], flush=True)
    results["transformers generate"] = transformers_measures(loaded.model, tokenizer, Prompts(tokenizer, book_ids), args.repeats)
    print("transformers:", results["transformers generate"], flush=True)
    version = subprocess.run(
        [args.peers_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    print(f"\nllama-cpp-python {version}, 2 threads; `{' '.join(sys.argv)}`\n")
    print(table(results))


if __name__ == "__main__":
    main()
