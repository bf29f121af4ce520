"""Decode steps of SmolLM2-135M stepped by hand on CUDA, bf16, a 512-token prompt, 128 greedy
steps (medians of three): eager with a dynamic cache, eager with a static cache, and the static-cache
step under `torch.compile(mode="reduce-overhead")` (CUDA graphs), at batch 1 and 8. What a compiled
decode path could reach (issue 16); run on the GPU machine (docs/gpu.md):

    bash scripts/gpu/check.sh tests   # once, to install and convert the model; then
    PYTHONPATH=$PWD:/tmp/site LONGDOC_CACHE_DIR=/tmp/longdoc-cache python3 -m bench.bench_compiled_decode
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from engine.config import DEFAULT_CACHE_DIR, SMALL_MODEL

STEPS = 128
PROMPT = 512


def sync() -> None:
    torch.cuda.synchronize()


@torch.inference_mode()
def eager(model, ids: torch.Tensor) -> float:
    cache = DynamicCache()
    tok = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    sync()
    started = time.perf_counter()
    for _ in range(STEPS):
        tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    sync()
    return STEPS / (time.perf_counter() - started)


@torch.inference_mode()
def static(model, ids: torch.Tensor, step) -> float:
    cache = StaticCache(config=model.config, max_cache_len=2 * PROMPT)
    out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(PROMPT, device="cuda"), use_cache=True)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    sync()
    started = time.perf_counter()
    for i in range(STEPS):
        tok = step(tok, torch.tensor([PROMPT + i], device="cuda"), cache)[:, -1].argmax(-1, keepdim=True).clone()
    sync()
    return STEPS / (time.perf_counter() - started)


def main() -> None:
    folder = Path(os.environ.get("LONGDOC_CACHE_DIR", DEFAULT_CACHE_DIR)) / "models" / SMALL_MODEL
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()  # type: ignore[call-arg]  # transformers' @wraps(nn.Module.cuda) hides the bound self from mypy
    prompt = torch.randint(100, 40000, (1, PROMPT), device="cuda")

    def step(tok, position, cache):
        return model(input_ids=tok, past_key_values=cache, cache_position=position, use_cache=True).logits

    compiled = torch.compile(step, mode="reduce-overhead")
    runs = {
        "eager, dynamic cache": lambda ids: eager(model, ids),
        "eager, static cache": lambda ids: static(model, ids, step),
        "compiled static cache (CUDA graphs)": lambda ids: static(model, ids, compiled),
    }
    for name, run in runs.items():
        for batch in (1, 8):
            ids = prompt.repeat(batch, 1)
            try:
                started = time.perf_counter()
                run(ids), run(ids)  # warm-up (and compiling)
                warm = time.perf_counter() - started
                rate = statistics.median(run(ids) for _ in range(3))
                print(f"{name}, batch {batch}: {rate:.1f} steps/s ({rate * batch:.0f} tok/s), warm-up {warm:.1f} s", flush=True)
            except Exception:
                traceback.print_exc()


if __name__ == "__main__":
    main()
