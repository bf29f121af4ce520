"""Questions for adapting the retriever: the served reader writes one question about each of a
sample of passages from the training split (never a QA text, held-out or development).

Passages are 128 of the reader's tokens, cut where the text memory cuts its chunks (every 128
tokens from a book's start), sampled at random (seed 0) over every book. The reader (greedy, one
worked example in the prompt) is asked for a factual question in plain modern words rather than
the passage's own, as readers of these old books ask (research/evals/qa_dev.jsonl); each line of
the output names the book and the passage's characters.

    .venv/bin/python -m research.training.retriever_questions --count 1536 --out runs/retriever/pairs.jsonl
    .venv/bin/python -m research.training.retriever_questions --count 1536 --skip 1536 --out runs/retriever/pairs2.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.config import DEFAULT_MODEL, operator_cache_dir
from engine.models.loader import load_model
from engine.prompts import render
from research.evals.texts import DEV_TEXTS
from research.training.corpus import DEFAULT_DIR, fetch, split

PASSAGE_TOKENS = 128
ASK = (
    "Write one factual question about a detail of this passage, whose answer is a name, a number, a place, "
    'an object or a short phrase found in it. Ask it as a reader of the whole book would: never say "the passage" or "mentioned", '
    "and use plain modern words instead of the passage's own wording. Write only the question."
)
EXAMPLE = (  # Exodus 2:3-4 (a training book), and a question in the words asked for
    "And when she could not longer hide him, she took for him an ark of bulrushes, and daubed it with slime and with "
    "pitch, and put the child therein; and she laid it in the flags by the river's brink. And his sister stood afar off, "
    "to wit what would be done to him.",
    "What did the baby's mother coat the little basket with before leaving it among the reeds?",
)


def _turn(passage: str) -> dict[str, str]:
    return {"role": "user", "content": f"Passage:\n{passage}\n\n{ASK}"}


def prompt(tokenizer: PreTrainedTokenizerBase, passage: str) -> list[int]:
    shot = [_turn(EXAMPLE[0]), {"role": "assistant", "content": EXAMPLE[1]}]
    return render(tokenizer, [*shot, _turn(passage)])


def passages(
    tokenizer: PreTrainedTokenizerBase, books: list[Path], count: int, seed: int, skip: int = 0
) -> list[tuple[str, int, int]]:
    """(book name, start, end) of `count` passages drawn from every PASSAGE_TOKENS-token cut of `books`,
    after the first `skip` of the same draw (so runs with the same seed never share a passage)."""
    pool = []
    for book in books:
        offsets = tokenizer(book.read_text(encoding="utf-8"), add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"
        ]
        for first in range(0, len(offsets) - PASSAGE_TOKENS, PASSAGE_TOKENS):
            pool.append((book.name, offsets[first][0], offsets[first + PASSAGE_TOKENS - 1][1]))
    random.Random(seed).shuffle(pool)
    return pool[skip : skip + count]


@torch.inference_mode()
def questions(model: Any, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Greedy questions for a batch of prompts (left-padded), each its first line."""
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    texts = [str(tokenizer.decode(row, skip_special_tokens=True)) for row in out[:, width:]]
    return [text.strip().split("\n")[0] for text in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1536)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", type=int, default=0, help="passages of the draw to pass over (written by an earlier run)")
    args = parser.parse_args()
    loaded = load_model(args.model, cache_dir=operator_cache_dir(), device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    tokenizer.padding_side = "left"
    excluded = {spec.source for spec in DEV_TEXTS}
    books = [book for book in split(fetch(DEFAULT_DIR))[0] if book.name not in excluded]
    texts = {book.name: book.read_text(encoding="utf-8") for book in books}
    chosen = passages(tokenizer, books, args.count, args.seed, args.skip)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as out:
        for start in range(0, len(chosen), args.batch):
            started, rows = time.perf_counter(), chosen[start : start + args.batch]
            asked = questions(
                model, tokenizer, [prompt(tokenizer, texts[name][start:end].strip()) for name, start, end in rows], 32
            )
            for (name, a, b), question in zip(rows, asked, strict=True):
                out.write(json.dumps({"book": name, "start": a, "end": b, "question": question}) + "\n")
            out.flush()
            print(f"{start + len(rows)}/{len(chosen)} in {time.perf_counter() - started:.0f} s: {asked[-1]}", flush=True)


if __name__ == "__main__":
    main()
