"""Resident memory of a served model once loaded: the weights, `--quantize`'s copy beside them, and
the batched decoder built over them (its fused projections), as `longdoc serve` holds them.

Linux only (/proc/self/status). RssAnon is memory the process owns; RssFile is pages of the model's
safetensors files mapped into it, which the kernel can drop and read again.

    .venv/bin/python -m bench.bench_resident --model qwen2.5-coder-1.5b-instruct [--quantize int8]
"""

from __future__ import annotations

import argparse
import gc
import resource

from engine.config import DEFAULT_CACHE_DIR, DEFAULT_MODEL, QUANTIZE_MODES
from engine.models.llama_step import BatchDecoder
from engine.models.loader import load_model
from engine.models.quantize import quantize_linears
from engine.runtime.os_memory import return_free_memory


def status_gb(*fields: str) -> dict[str, float]:
    """The named fields of /proc/self/status (reported in kB), in GB."""
    found = {}
    for line in open("/proc/self/status"):
        name, _, value = line.partition(":")
        if name in fields:
            found[name] = int(value.split()[0]) * 1024 / 1e9
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quantize", default="none", choices=QUANTIZE_MODES)
    args = parser.parse_args()
    loaded = load_model(args.model, cache_dir=DEFAULT_CACHE_DIR, device="cpu")
    quantize_linears(loaded.model, args.quantize)
    BatchDecoder(loaded.model)
    gc.collect()
    return_free_memory()  # as the server does once a model is loaded
    now = status_gb("VmRSS", "RssAnon", "RssFile")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # kB on Linux
    print(
        f"{args.model} ({loaded.model.dtype}, --quantize {args.quantize}): RSS {now['VmRSS']:.2f} GB "
        f"(anonymous {now['RssAnon']:.2f}, file-backed {now['RssFile']:.2f}), peak {peak:.2f} GB"
    )


if __name__ == "__main__":
    main()
