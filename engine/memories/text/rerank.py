"""Reranking by the reader: each candidate passage is scored by how likely the served model finds
the question after it (query likelihood, as in UPR: Sachan et al., 2022). The model that will
answer judges which excerpt the question is about; no other model is needed.

A pass runs the passages in batches of `BATCH` rows with no key/value cache, and the output head
only over the question's tokens (at most `QUESTION_TOKENS` of them), in slices of `DECODE_ROWS`
rows (so a weight-only head keeps its low-precision kernel), so what it allocates depends on the
batch, the chunk size and the question's cap, not on the question's length. The head's logits are
taken as they are: a model that rescales or caps them after the head (Gemma 2's softcapping,
Cohere's logit scale) is ranked by its uncapped scores.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.models.quantize import DECODE_ROWS
from engine.prompts import render

ASK = "Write a question about this passage."
BATCH = 8  # passages in one forward pass
QUESTION_TOKENS = 64  # the question's tokens scored (its start)


def _pair(tokenizer: PreTrainedTokenizerBase, passage: str, question_ids: list[int]) -> tuple[list[int], int]:
    """The passage and the request for a question as a user turn, then the question as the
    assistant's answer: (ids, how many of the last ids are the question's)."""
    head = render(tokenizer, [{"role": "user", "content": f"Passage:\n{passage.strip()}\n\n{ASK}"}])
    return head + question_ids, len(question_ids)


def frame_tokens(tokenizer: PreTrainedTokenizerBase) -> int:
    """Tokens around a passage: the chat template and the request for a question."""
    return len(_pair(tokenizer, "", [])[0])


def question_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """The question's tokens that are scored: its first QUESTION_TOKENS."""
    return list(tokenizer(question.strip(), add_special_tokens=False)["input_ids"])[:QUESTION_TOKENS]


@torch.inference_mode()
def question_likelihood(model: Any, tokenizer: PreTrainedTokenizerBase, passages: list[str], question: str) -> list[float]:
    """Per passage, the mean log-probability of the question's tokens after it."""
    asked = question_ids(tokenizer, question)
    if not asked:
        return [0.0] * len(passages)
    pairs = [_pair(tokenizer, passage, asked) for passage in passages]
    scores: list[float] = []
    for start in range(0, len(pairs), BATCH):
        scores += _batch_scores(model, pairs[start : start + BATCH])
    return scores


def _batch_scores(model: Any, pairs: list[tuple[list[int], int]]) -> list[float]:
    """One forward pass over right-padded rows (so each keeps positions 0..n-1); the head runs on
    the positions that predict the question's tokens only."""
    device = next(model.parameters()).device
    longest = max(len(ids) for ids, _ in pairs)
    ids = torch.zeros(len(pairs), longest, dtype=torch.long)  # [B, T]
    mask = torch.zeros_like(ids)  # [B, T]: 1 on each row's own tokens
    for row, (row_ids, _) in enumerate(pairs):
        ids[row, : len(row_ids)] = torch.tensor(row_ids)
        mask[row, : len(row_ids)] = 1
    ids, mask = ids.to(device), mask.to(device)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # [B, T, d]
    head = model.get_output_embeddings()
    scores = []
    for row, (row_ids, asked) in enumerate(pairs):
        end = len(row_ids)
        states = hidden[row, end - asked - 1 : end - 1]  # [asked, d]: position i predicts token i + 1
        logits = torch.cat([head(states[i : i + DECODE_ROWS]) for i in range(0, asked, DECODE_ROWS)]).float()  # [asked, vocab]
        targets = ids[row, end - asked : end, None]  # [asked, 1]
        scores.append(float(torch.log_softmax(logits, -1).gather(-1, targets).mean()))
    return scores


def pass_bytes(config: Any, tokens: int, passages: int, element_bytes: int) -> int:
    """An estimate, meant as an upper one, of what one reranking pass over rows of at most `tokens`
    tokens holds at its peak: per token, the residual stream and a layer's activations (attention's
    projections, three float32 copies of its scores, the MLP's three projections), and the head's
    float32 logits over the scored question tokens."""
    rows = min(passages, BATCH)
    hidden = int(config.hidden_size)
    inner = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    per_token = element_bytes * (6 * hidden + 3 * inner) + 12 * int(config.num_attention_heads) * tokens
    head = 3 * 4 * QUESTION_TOKENS * int(config.vocab_size)  # one row's logits, their log-softmax, a float copy
    return rows * tokens * per_token + head
