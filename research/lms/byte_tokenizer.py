"""The tokenizer of the from-scratch byte-level LMs: one token per UTF-8 byte (ids 0-255).

It offers the part of the Hugging Face tokenizer interface the engine uses: calling it (with
character offsets), `decode`, and a plain-text `apply_chat_template`. The models were trained on
books, not chats, so a conversation is rendered as paragraphs of text for the model to continue.
"""

from __future__ import annotations

from typing import Any


class ByteTokenizer:
    chat_template = "paragraphs"  # not a Jinja template: see apply_chat_template
    eos_token_id = None
    unk_token_id = None
    vocab_size = 256

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False) -> dict[str, Any]:
        data = text.encode("utf-8")
        encoded: dict[str, Any] = {"input_ids": list(data)}
        if return_offsets_mapping:
            if len(data) == len(text):  # ASCII: byte i is character i
                encoded["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
            else:  # every byte of a character carries that character's span
                encoded["offset_mapping"] = [(i, i + 1) for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8")))]
        return encoded

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def convert_tokens_to_ids(self, token: str) -> None:
        return None  # no special tokens

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> Any:
        text = "\n\n".join(m["content"].strip() for m in messages) + ("\n" if add_generation_prompt else "")
        return self(text)["input_ids"] if tokenize else text
