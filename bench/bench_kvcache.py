"""kvcache speed against the plain model, in process, on SmolLM2-135M unless --model names another (2 CPU cores here).

- ingestion: tokens/s ingesting a held-out text into a kvcache memory as the server does (its
  segments, and for selection "text" the text index too), against the plain model's forward over
  chunks of the window's size (the issue's yardstick), timed between the fed segments (before
  every `PLAIN_EVERY`th) so that both meet the same state of the machine; its median;
- decode: tokens/s of a kvcache answer after that text, against the server's plain decoding (its
  batched decoder on one row: the C step where it runs) after (a) the same question alone and
  (b) a prompt as long as what the kvcache answer attends to. kvcache's decode steps run as the
  C step too, unless `--torch-steps` (with selection "summary" or "keys" those that reselect
  through its per-layer hook; with "text", the default, no step reselects);
- TTFT: the prompt pass of a question after the text (for selection "text" with the text index's
  ranking first).

The text is Alice in Wonderland (the question is about it), followed by the QA benchmark's other
held-out texts in turn while `--tokens` asks for more: Alice alone is about 39K tokens.

Medians over warm repeats. Prints a Markdown table.

    .venv/bin/python -m bench.bench_kvcache --tokens 16384 [--options '{"ingest_selection": false}'] [--torch-steps] [--model NAME]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from engine.config import DEFAULT_CACHE_DIR, SHIPPED_EMBEDDER_ADAPTER, SMALL_MODEL, IngestConfig
from engine.ingest import TokenizedDocument, ingest_steps, tokenize_document
from engine.interface import GenerationParams, IngestDone
from engine.memories.base import MemoryContext
from engine.memories.kvcache.memory import KVCacheMemory, KVCacheOptions
from engine.memories.kvcache.select import SelectiveModel
from engine.models import manifest as manifests
from engine.models.embedder import Embedder
from engine.models.llama_step import BatchDecoder, Row
from engine.models.loader import LoadedModel, load_model
from engine.prompts import after_document
from engine.runtime.generation import AnswerState, StopTokens
from engine.runtime.registry import valid_manifest_options
from research.evals import texts

QUESTION = "What did the Mock Turtle sing about?"
PLAIN_EVERY = 4  # fed segments between two timings of the plain forward
SEGMENT_LEN = IngestConfig().segment_len  # the server's segments of a document


def document(tokens: int) -> str:
    """Alice, then the other held-out QA texts, joined until they hold 8 characters for each token
    asked: more than enough, as the served models' tokens average about 4 characters of English.
    Up to 16K tokens this is Alice alone, as before the other texts were added."""
    parts: list[str] = []
    for spec in texts.TEXTS:
        parts.append(texts.load(spec.name, texts.QA_DIR))
        if sum(map(len, parts)) > 8 * tokens:
            break
    return "\n\n".join(parts)


def cut(doc: TokenizedDocument, tokens: int) -> TokenizedDocument:
    """The document's first `tokens` tokens, and its text up to their end."""
    spans = doc.token_spans[:tokens]
    return TokenizedDocument(doc.id, doc.name, doc.text[: int(spans[-1, 1])], doc.token_ids[:tokens], spans)


def kvcache_memory(loaded: LoadedModel, options: dict) -> KVCacheMemory:
    """A session's kvcache memory over the loaded model, as the server makes it (with the text
    embedder, which selection "text" indexes the document with)."""
    context = MemoryContext(
        tokenizer=loaded.tokenizer,
        embedder=Embedder(adapter=SHIPPED_EMBEDDER_ADAPTER, device=loaded.device, dtype=loaded.dtype)
        if KVCacheOptions(**options).selection == "text"
        else None,
        model=loaded.model,
        context_len=loaded.context_len,
        manifest_options=valid_manifest_options(loaded.name, manifests.manifest_of(loaded.name, loaded.source)),
    )
    return KVCacheMemory(context, options)


def plain_decode(decoder: BatchDecoder, tokenizer, prompt: list[int], steps: int) -> float:
    """Seconds per token decoding `steps` tokens greedily after `prompt`, as the server decodes a lone answer."""
    row = Row(prompt, GenerationParams(max_tokens=steps + 1))
    row.state = state = AnswerState(tokenizer, prompt, row.params, StopTokens(frozenset()))
    state.next_token = int(decoder.prefill(row).argmax())
    started = time.perf_counter()
    for _ in range(steps):
        state.next_token = int(decoder.step([row])[0].argmax())
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384, help="document tokens to feed")
    parser.add_argument("--options", default="{}", help="kvcache options, JSON")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-steps", action="store_true", help="kvcache decode steps in torch only (no C step)")
    parser.add_argument("--model", default=SMALL_MODEL, help="a model by name or a local folder")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    loaded = load_model(args.model, cache_dir=DEFAULT_CACHE_DIR, device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    options = json.loads(args.options)
    memory = kvcache_memory(loaded, options)
    if args.torch_steps:
        memory.selective = SelectiveModel(model, memory.selective.config, None)
    window = memory.options.window
    decoder = BatchDecoder(model)
    doc = cut(tokenize_document(tokenizer, "bench", "bench", document(args.tokens)), args.tokens)
    chunk = torch.tensor([doc.token_ids[:window].tolist()])

    def plain_forward() -> float:
        """Seconds of one prefill over the document's first `window` tokens: no logits but the last."""
        with torch.inference_mode():
            started = time.perf_counter()
            model(input_ids=chunk, logits_to_keep=1)
            return time.perf_counter() - started

    plain_forward()  # warm-up
    feeding, plain = 0.0, []
    steps = ingest_steps(memory, doc, segment_len=SEGMENT_LEN, reserve=lambda n: None, on_commit=lambda info: None)
    for n in itertools.count():
        if n % PLAIN_EVERY == 0:  # the yardstick under the same conditions as the feeding around it
            plain.append(plain_forward())
        started = time.perf_counter()
        event = next(steps)
        feeding += time.perf_counter() - started
        if isinstance(event, IngestDone):
            break
    plain_rate = window / statistics.median(plain)
    ingest_rate = len(doc.token_ids) / feeding

    prompt = tokenizer(after_document(tokenizer, [], QUESTION), add_special_tokens=False)["input_ids"]

    def answer() -> tuple[float, float]:
        begun = time.perf_counter()
        run = memory.selective_answer(QUESTION, len(prompt) + args.steps + 1)[0]
        logits = run.forward(prompt)
        ttft = time.perf_counter() - begun
        begun = time.perf_counter()
        for _ in range(args.steps):
            logits = run.forward([int(logits.argmax())])
        return ttft, (time.perf_counter() - begun) / args.steps

    answer()
    runs = [answer() for _ in range(args.repeats)]
    ttft = statistics.median(r[0] for r in runs)
    kv_step = statistics.median(r[1] for r in runs)
    attended = memory.selective_answer(QUESTION, 1)[0].length + len(prompt)
    question_alone = statistics.median(plain_decode(decoder, tokenizer, prompt, args.steps) for _ in range(args.repeats))
    same_span = statistics.median(
        plain_decode(decoder, tokenizer, doc.token_ids[-attended:].tolist(), args.steps) for _ in range(args.repeats)
    )
    print(
        f"| document tokens | options | plain forward @{window} tok/s | kvcache ingest tok/s | ratio | "
        f"kvcache decode tok/s | plain decode, question alone | ratio | plain decode, {attended}-token prompt | ratio | TTFT s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {len(doc.token_ids):,} | `{args.options}`{' torch steps' if args.torch_steps else ''} | {plain_rate:,.0f} | {ingest_rate:,.0f} | {ingest_rate / plain_rate:.2f} | "
        f"{1 / kv_step:.1f} | {1 / question_alone:.1f} | {question_alone / kv_step:.2f} | {1 / same_span:.1f} | "
        f"{same_span / kv_step:.2f} | {ttft:.2f} |"
    )


if __name__ == "__main__":
    main()
