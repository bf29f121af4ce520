"""Adapt the text memory's sentence embedder (MiniLM) to questions about old books, with LoRA.

Pairs are (question, passage) from `retriever_questions.py` (the served reader writes a question
about a passage of a training-split book). Each batch takes questions about one book; a question
is scored against every passage of the batch and as many other passages of the same book
(contrastive, softmax over scaled cosine similarities: in-batch and same-book negatives, as the
memory ranks the chunks of one document). Only the adapter's low-rank factors are trained; the
base weights stay frozen, so the saved adapter is small and zero B gives the base model back.

    .venv/bin/python -m research.training.retriever_train --pairs runs/retriever/pairs.jsonl --out runs/retriever/adapter
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.memories.text.lexical import LexicalIndex
from engine.models.embedder import Embedder, mean_pooled
from engine.models.embedder_adapter import AdapterConfig, save_adapter, target_names
from research.training.corpus import DEFAULT_DIR
from research.training.schedule import lr_factor


@dataclass(frozen=True)
class Pair:
    book: str
    question: str
    passage: str
    start: int = 0  # the passage's characters in its book
    end: int = 0


class LoraLinear(torch.nn.Module):
    """y = base(x) + scale · x Aᵀ Bᵀ, with A random and B zero at the start (the base model)."""

    def __init__(self, base: torch.nn.Linear, rank: int, scale: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base, self.scale = base, scale
        self.A = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=generator) / base.in_features**0.5)
        self.B = torch.nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.A), self.B)


def with_lora(model: torch.nn.Module, config: AdapterConfig, seed: int) -> dict[str, LoraLinear]:
    """Replace each target Linear of `model` by a LoraLinear around it; the base weights are frozen."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    wrapped = {}
    for name in config.targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped[name] = LoraLinear(getattr(parent, child), config.rank, config.scale, generator)
        setattr(parent, child, wrapped[name])
    return wrapped


def usable(question: str) -> bool:
    """A question, and one that does not lean on "the passage" (which a reader of the whole book cannot ask)."""
    return question.endswith("?") and not any(word in question.lower() for word in ("passage", "mentioned"))


def load_pairs(path: Path, corpus_dir: Path = DEFAULT_DIR) -> list[Pair]:
    texts: dict[str, str] = {}
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row["book"] not in texts:
            texts[row["book"]] = (corpus_dir / row["book"]).read_text(encoding="utf-8")
        passage = texts[row["book"]][row["start"] : row["end"]].strip()
        pairs.append(Pair(row["book"], row["question"], passage, row["start"], row["end"]))
    return pairs


def hard_negatives(pairs: list[Pair], corpus_dir: Path = DEFAULT_DIR, width: int = 512) -> dict[Pair, str]:
    """Per pair, the stretch of its book (`width` characters, cut every `width`) that BM25 ranks
    first for its question among those that do not touch its passage: a near miss of the words,
    which the dense ranking should learn to place below the passage."""
    by_book: dict[str, list[Pair]] = defaultdict(list)
    for pair in pairs:
        by_book[pair.book].append(pair)
    negatives = {}
    for book, book_pairs in by_book.items():
        text = (corpus_dir / book).read_text(encoding="utf-8")
        starts = list(range(0, len(text), width))
        index = LexicalIndex().build([text[a : a + width] for a in starts])
        for pair in book_pairs:
            scores = index.scores(pair.question)
            for i in np.argsort(-scores, kind="stable").tolist():
                if not (starts[i] < pair.end and pair.start < starts[i] + width):
                    negatives[pair] = text[starts[i] : starts[i] + width].strip()
                    break
    return negatives


def batches(pairs: list[Pair], size: int, rng: random.Random) -> list[list[Pair]]:
    """Batches of questions about one book each (a book's last few questions share a batch with the next book's)."""
    by_book: dict[str, list[Pair]] = defaultdict(list)
    for pair in pairs:
        by_book[pair.book].append(pair)
    ordered: list[Pair] = []
    for book in rng.sample(sorted(by_book), len(by_book)):
        ordered += rng.sample(by_book[book], len(by_book[book]))
    cut = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    return rng.sample(cut, len(cut))


def encode(embedder: Embedder, texts: list[str]) -> torch.Tensor:
    """Mean-pooled, normalised vectors with gradients (as Embedder.encode computes them)."""
    batch = embedder.tokenizer(texts, padding=True, truncation=True, max_length=embedder.max_length, return_tensors="pt")
    return mean_pooled(embedder.model(**batch).last_hidden_state, batch["attention_mask"])


def loss_of(embedder: Embedder, batch: list[Pair], extra: list[str], scale: float) -> torch.Tensor:
    questions = encode(embedder, [p.question for p in batch])
    passages = encode(embedder, [p.passage for p in batch] + extra)
    logits = scale * questions @ passages.T
    return F.cross_entropy(logits, torch.arange(len(batch)))


def recall_at(embedder: Embedder, pairs: list[Pair], k: int) -> float:
    """Per book, each question against all that book's passages: the share whose own passage is in the first k."""
    by_book: dict[str, list[Pair]] = defaultdict(list)
    for pair in pairs:
        by_book[pair.book].append(pair)
    hits = 0
    with torch.no_grad():
        for book_pairs in by_book.values():
            sims = encode(embedder, [p.question for p in book_pairs]) @ encode(embedder, [p.passage for p in book_pairs]).T
            top = sims.topk(min(k, sims.shape[1]), dim=1).indices
            hits += int((top == torch.arange(len(book_pairs))[:, None]).any(1).sum())
    return hits / max(1, len(pairs))


def train(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    pairs = [p for path in args.pairs for p in load_pairs(path) if usable(p.question)]
    books = sorted({p.book for p in pairs})
    valid_books = set(rng.sample(books, max(1, len(books) // 10)))
    valid = [p for p in pairs if p.book in valid_books]
    training = [p for p in pairs if p.book not in valid_books]
    print(f"{len(training)} training pairs, {len(valid)} validation pairs ({len(valid_books)} books)", flush=True)
    embedder = Embedder()
    config = AdapterConfig(args.rank, args.alpha, tuple(target_names(embedder.model)))
    lora = with_lora(embedder.model, config, args.seed)
    parameters = [p for module in lora.values() for p in (module.A, module.B)]
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=0.0)
    passages_by_book: dict[str, list[str]] = defaultdict(list)
    for p in training:
        passages_by_book[p.book].append(p.passage)
    hard = hard_negatives(training) if args.hard else {}
    embedder.model.eval()  # no dropout: the base model's own statistics
    print(f"before: validation recall@1 {recall_at(embedder, valid, 1):.3f} @4 {recall_at(embedder, valid, 4):.3f}", flush=True)
    schedule = [b for _ in range(args.epochs) for b in batches(training, args.batch, rng)]
    for step, batch in enumerate(schedule):
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(step, args.warmup, len(schedule), 0.1)
        own = {p.passage for p in batch}
        pool = [t for t in passages_by_book[batch[0].book] if t not in own]
        extra = [hard[p] for p in batch if p in hard] + rng.sample(pool, min(args.negatives, len(pool)))
        loss = loss_of(embedder, batch, extra, args.scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == len(schedule) - 1:
            print(f"step {step}/{len(schedule)} loss {loss.item():.3f} {time.perf_counter() - started:.1f}s", flush=True)
    print(f"after: validation recall@1 {recall_at(embedder, valid, 1):.3f} @4 {recall_at(embedder, valid, 4):.3f}", flush=True)
    save_adapter(args.out, config, {name: (m.A, m.B) for name, m in lora.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--negatives", type=int, default=32)
    parser.add_argument("--scale", type=float, default=20.0)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hard", action=argparse.BooleanOptionalAction, default=True, help="BM25's best wrong stretch as a negative"
    )
    train(parser.parse_args())


if __name__ == "__main__":
    main()
