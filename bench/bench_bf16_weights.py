"""What storing SmolLM2-135M in bf16 (as the image does) changes, served in float32.

SmolLM2-135M is dequantized from a Q4_1 GGUF; its float32 values are not all bf16 values, so
the image's bf16 copy is a rounding of them. Over windows of a held-out text (Alice, the test
fixture), this prints the share of weights bf16 keeps exactly, the top-1 agreement of next-token
predictions, the mean KL divergence and the perplexity of both.

    .venv/bin/python -m bench.bench_bf16_weights [--windows 8 --window 1024]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import DEFAULT_CACHE_DIR
from engine.models.loader import small_model_dir

BOOK = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "alice29.txt"


def load(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args()
    whole_dir = small_model_dir(args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="longdoc-bf16-") as scratch:
        whole, half = load(whole_dir), load(small_model_dir(Path(scratch), dtype=torch.bfloat16))
    params = list(whole.state_dict().values())
    exact = sum((p == p.to(torch.bfloat16).float()).sum().item() for p in params) / sum(p.numel() for p in params)
    ids = AutoTokenizer.from_pretrained(whole_dir)(BOOK.read_text(encoding="utf-8")).input_ids
    agree = kl = nll_whole = nll_half = 0.0
    count = 0
    with torch.no_grad():
        for w in range(args.windows):
            window = torch.tensor([ids[w * args.window : (w + 1) * args.window]])
            a = torch.log_softmax(whole(window).logits[0].float(), -1)
            b = torch.log_softmax(half(window).logits[0].float(), -1)
            targets = window[0, 1:, None]
            agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
            kl += (a.exp() * (a - b)).sum(-1).sum().item()
            nll_whole -= a[:-1].gather(1, targets).sum().item()
            nll_half -= b[:-1].gather(1, targets).sum().item()
            count += window.shape[1]
    predicted = count - args.windows
    print(f"| weights bf16 keeps exactly | {exact:.3f} |")
    print(f"| top-1 agreement over {count} positions | {agree / count:.4f} |")
    print(f"| mean KL(float32 || bf16-stored) | {kl / count:.2e} |")
    print(f"| perplexity float32 / bf16-stored | {math.exp(nll_whole / predicted):.4f} / {math.exp(nll_half / predicted):.4f} |")


if __name__ == "__main__":
    main()
