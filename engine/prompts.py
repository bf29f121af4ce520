"""Prompts: document context and chat messages rendered with the model's own chat template."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:  # engine.memories builds prompts with these helpers
    from engine.memories.base import ContextPiece

Messages = list[dict[str, str]]

INSTRUCTION = "Answer the question using the document excerpts above. Answer briefly."


def _format(question: str, excerpts: str) -> str:
    return f"Document excerpts:\n\n{excerpts}\n\n{INSTRUCTION}\nQuestion: {question}"


def with_context(question: str, pieces: list[ContextPiece]) -> str:
    """One user turn: the retrieved excerpts in document order, then the question."""
    if not pieces:
        return question
    excerpts = "\n\n".join(piece.text.replace("\r\n", "\n").strip() for piece in pieces)
    return _format(question, excerpts)


def render(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def overhead_tokens(tokenizer: PreTrainedTokenizerBase, messages: Messages, question: str) -> int:
    """Prompt tokens besides the excerpts: earlier turns, template, instruction, question, separators."""
    framed = [*messages, {"role": "user", "content": _format(question, "")}]
    return len(render(tokenizer, framed)) + 32


def history_tokens(tokenizer: PreTrainedTokenizerBase, history: Messages, prompt_ids: list[int]) -> int:
    """How many leading tokens of `prompt_ids` are the rendered earlier turns `history`; 0 without
    history, or when the chat template does not render them as a prefix of the prompt."""
    if not history:
        return 0
    text = tokenizer.apply_chat_template(history, add_generation_prompt=False, tokenize=False)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return len(ids) if prompt_ids[: len(ids)] == ids else 0


DOCUMENT_MARK = "\x00longdoc-document\x00"


def document_frame(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """The chat template around a document fed into a model's own cache: (text before the
    document, the template's end of a turn and the assistant's start). The document sits inside
    the first user turn; the question follows it in the same turn (`after_document`)."""
    turn = [{"role": "user", "content": f"Document:\n\n{DOCUMENT_MARK}"}]
    text = cast(str, tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False))  # tokenize=False: the text
    before, after = text.split(DOCUMENT_MARK)
    return before, after


def after_document(tokenizer: PreTrainedTokenizerBase, history: Messages, question: str) -> str:
    """What follows the fed document: earlier turns as text, the instruction, the question,
    then the end of the turn and the assistant's start."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in history if m.get("content")]
    earlier = "Earlier in this conversation:\n" + "\n".join(lines) + "\n\n" if lines else ""
    instruction = INSTRUCTION.replace("document excerpts", "document")
    return f"\n\n{earlier}{instruction}\nQuestion: {question}" + document_frame(tokenizer)[1]
