"""`longdoc train lm` / `longdoc eval lm`: from-scratch byte-level language models on the offline corpus.

Bytes, not SmolLM2-135M's tokenizer: a 49k-token embedding would be most of a <= 10 MB model,
and bits per byte compare architectures directly (the paper's enwik8 figures are bits per byte too).
"""

from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from research.lms import build
from research.lms.lm_common import LanguageModel, LMConfig
from research.lms.lm_io import load_checkpoint, save_checkpoint
from research.training.corpus import DEFAULT_DIR, fetch, split
from research.training.schedule import lr_factor


@dataclass
class LMTrainConfig:
    arch: str = "cacheformer"
    model: dict[str, Any] = field(default_factory=dict)  # LMConfig fields
    out: Path = Path("runs/lm")
    corpus_dir: Path = DEFAULT_DIR
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    accumulation: int = 1
    lr: float = 1e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 200
    eval_bytes: int = 65_536
    eval_scored: int | None = None  # bits_per_byte's `scored`: None, or the last n of windows every n bytes
    device: str = "auto"
    resume: bool = False
    init: Path | None = None  # start from this checkpoint's weights (its model config; max_seq_len = seq_len)


def corpus_bytes(corpus_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    train_files, held_out = split(fetch(corpus_dir))
    as_bytes = lambda files: np.frombuffer(b"\n".join(f.read_bytes() for f in files), dtype=np.uint8)  # noqa: E731
    return as_bytes(train_files), as_bytes(held_out)


@torch.inference_mode()
def bits_per_byte(model: LanguageModel, data: np.ndarray, seq_len: int, limit: int, scored: int | None = None) -> float:
    """Held-out bits per byte over windows of `seq_len` (+1 target) bytes.

    scored=None: consecutive windows, each scoring every position the model predicts (all of them,
    or a Perceiver's latent). scored=n: windows every n bytes, each scoring its last n positions, so
    every family scores the same bytes, each with at least seq_len - n bytes before it.
    """
    device = next(model.parameters()).device
    total, count = 0.0, 0
    usable = min(limit, len(data) - 1)
    starts = range(0, usable - 1, seq_len) if scored is None else range(0, usable - seq_len, scored)
    for start in starts:
        window = torch.from_numpy(data[start : min(start + seq_len + 1, usable + 1)].astype(np.int64)).to(device)
        if len(window) < 2:
            break
        logits = model(window[None, :-1])[0]
        if scored is not None and len(logits) < scored:
            raise ValueError(f"{model.arch} predicts {len(logits)} positions a window; it cannot score the last {scored}")
        keep = len(logits) if scored is None else scored
        total += float(F.cross_entropy(logits[-keep:].float(), window[1:][-keep:], reduction="sum"))
        count += keep
    if count == 0:
        raise ValueError(f"{usable + 1} held-out bytes make no window of {seq_len}")
    return total / count / math.log(2)


def held_out_score(model: LanguageModel, held_out: np.ndarray, config: LMTrainConfig) -> float:
    model.eval()
    score = bits_per_byte(model, held_out, config.seq_len, config.eval_bytes, config.eval_scored)
    model.train()
    return score


def _device(name: str) -> torch.device:
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)


def initial_model(config: LMTrainConfig) -> LanguageModel:
    """A fresh model from `config.model`, or, with `config.init`, that checkpoint's model and weights
    with `max_seq_len` set to the training length (a fine-tune on longer sequences)."""
    if config.init is None:
        return build(config.arch, **{"max_seq_len": config.seq_len, **config.model})
    start = load_checkpoint(config.init)
    if start.arch != config.arch:
        raise ValueError(f"{config.init} holds a {start.arch} model, not {config.arch}")
    model = build(config.arch, **{**start.config.to_dict(), "max_seq_len": config.seq_len})
    model.load_state_dict(start.state_dict())
    return model


def train_lm(config: LMTrainConfig, command: str = "") -> dict[str, Any]:
    """Train to `config.steps`; returns the final summary (also written to out/summary.json)."""
    torch.manual_seed(config.seed)
    device = _device(config.device)
    train_data, held_out = corpus_bytes(config.corpus_dir)
    model = initial_model(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, config.warmup, config.steps, config.min_lr_ratio)
    )
    rng = np.random.default_rng(config.seed)
    step, out = 0, config.out
    out.mkdir(parents=True, exist_ok=True)
    if config.resume and (out / "trainer.pt").is_file():
        state = torch.load(out / "trainer.pt", weights_only=False)
        model.load_state_dict(load_checkpoint(out / "checkpoint").state_dict())
        optimizer.load_state_dict(state["optimizer"]), scheduler.load_state_dict(state["scheduler"])
        rng.bit_generator.state, step = state["rng"], state["step"]
    manifest: dict[str, Any] = {
        "command": command,
        "data": f"{config.corpus_dir} training split, {len(train_data)} bytes",
        "seed": config.seed,
        "train_config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
    }
    manifest["train_config"]["model"] = model.config.to_dict()  # what was trained (with --init: the checkpoint's)
    started, tokens, predicted, losses, eval_seconds = time.time(), 0, 0, [], 0.0
    final_score: float | None = None  # the held-out score at config.steps, once measured
    with tqdm(total=config.steps, initial=step, desc=f"train {config.arch}") as bar:
        while step < config.steps:
            model.train()
            for _ in range(config.accumulation):
                starts = rng.integers(0, len(train_data) - config.seq_len - 1, config.batch_size)
                batch = torch.from_numpy(np.stack([train_data[s : s + config.seq_len + 1] for s in starts]).astype(np.int64)).to(
                    device
                )
                logits = model(batch[:, :-1])  # B, L, V: predictions for the last L positions
                targets = batch[:, 1:][:, -logits.shape[1] :]
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                (loss / config.accumulation).backward()
                tokens += batch[:, :-1].numel()
                predicted += targets.numel()
                losses.append(float(loss.detach()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update(1)
            if step % config.checkpoint_every == 0 or step == config.steps:
                evaluating = time.time()
                point = {"step": step, "train_loss": float(np.mean(losses[-config.checkpoint_every :])), "train_tokens": tokens}
                point["heldout_bits_per_byte"] = held_out_score(model, held_out, config)
                final_score = point["heldout_bits_per_byte"] if step == config.steps else None
                point["train_seconds"] = evaluating - started - eval_seconds
                eval_seconds += time.time() - evaluating
                with (out / "curve.jsonl").open("a") as curve:
                    curve.write(json.dumps(point) + "\n")
                save_checkpoint(model, out / "checkpoint", **manifest, steps=step)
                torch.save(
                    {
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "rng": rng.bit_generator.state,
                        "step": step,
                    },
                    out / "trainer.pt",
                )
    elapsed = time.time() - started - eval_seconds
    model.eval()
    summary = {
        "arch": config.arch,
        "seed": config.seed,
        "parameters": model.num_parameters(),
        "steps": step,
        "train_loss_last_50": float(np.mean(losses[-50:])) if losses else None,
        "heldout_bits_per_byte": held_out_score(model, held_out, config) if final_score is None else final_score,
        "eval_scored": config.eval_scored,
        "train_tokens": tokens,
        "train_targets": predicted,
        "train_seconds": elapsed,
        "train_tokens_per_second": tokens / elapsed if elapsed > 0 else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
    }
    save_checkpoint(model, out / "checkpoint", **manifest, steps=step, eval=summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def default_model_config(**overrides: Any) -> dict[str, Any]:
    """The small ablation model: ~1.2M parameters, byte vocabulary."""
    base = LMConfig(
        vocab_size=256,
        dim=128,
        n_layers=4,
        n_heads=4,
        window=64,
        segment_len=16,
        compressed_per_segment=4,
        group_size=32,
        max_seq_len=512,
    )
    return {**asdict(base), **overrides}
