"""`longdoc train neurocache`: adapt a frozen causal LM with Neurocache.

Trains W_p (+ norm), the cache attention with its gates, and LoRA on the FFNs of the augmented
layers. Each batch row feeds one document segment by segment; its cache is reset when a new
document starts. AdamW, linear warm-up then cosine decay, gradient clipping, gradient
accumulation over segments, checkpoints and resume.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import PreTrainedModel

from engine.config import SMALL_MODEL, operator_cache_dir
from engine.memories.neurocache.adapter import CacheAttention, Neurocache, NeurocacheConfig
from engine.memories.neurocache.adapter_io import load_adapter, read_meta, save_adapter
from engine.memories.neurocache.state_cache import StateCache
from engine.models.loader import load_model
from research.training.corpus import DEFAULT_DIR, fetch, split
from research.training.neurocache_adapter import new_training_cache, training_caches
from research.training.neurocache_data import Episode, EpisodeSampler, tokenize_files
from research.training.schedule import lr_factor


@dataclass
class TrainConfig:
    model: str = SMALL_MODEL
    out: Path = Path("runs/neurocache")
    corpus_dir: Path = DEFAULT_DIR
    cache_dir: Path = field(default_factory=operator_cache_dir)  # LONGDOC_CACHE_DIR, as the server's
    device: str = "auto"
    steps: int = 200  # optimizer steps
    batch_size: int = 2
    segment_len: int = 256
    n_segments: int = 6
    accumulation: int = 2
    lr: float = 1e-4
    gate_lr: float = 1e-2  # gates and slot biases start at 0; at `lr` AdamW moves them by only ~lr a step
    warmup: int = 20
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    passkey_ratio: float = 0.5
    fact_ratio: float = 0.0  # share of episodes with a fact in prose and a question about it
    distractors: int = 0  # at most this many distractor facts per pass-key or fact episode
    repeats: float = 0.0  # share of pass keys made to hold a digit twice or more
    lm_stride: int = 4  # score every 4th position for the LM loss (answers always)
    seed: int = 0
    checkpoint_every: int = 50
    resume: bool = False
    init_adapter: Path | None = None  # start from this adapter's weights and settings (fine-tuning)
    neurocache: NeurocacheConfig = field(default_factory=lambda: NeurocacheConfig(capacity=16_384))


@dataclass
class Row:
    """One batch row: the document it feeds, where it is, and its cache."""

    cache: StateCache
    episode: Episode | None = None
    next_segment: int = 0
    document: int = 0


def scored_positions(answer: torch.Tensor, stride: int) -> torch.Tensor:
    """[B, L-1] bool: which next-token predictions are scored. Every `stride`-th position samples
    the language-modelling loss (the LM head over a 49k vocabulary costs as much as a third of the
    model), and every position whose target is an answer token is always scored."""
    B, L = answer.shape
    sampled = torch.zeros(B, L - 1, dtype=torch.bool, device=answer.device)
    sampled[:, stride - 1 :: stride] = True
    return sampled | answer[:, 1:]


def segment_loss(
    model: PreTrainedModel, hidden: torch.Tensor, ids: torch.Tensor, answer: torch.Tensor, stride: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean next-token loss over the scored positions, and over the answer tokens alone (None if none)."""
    scored = scored_positions(answer, stride)  # B, L-1
    head = model.get_output_embeddings()
    assert head is not None, "a causal LM has an output embedding"
    logits = head(hidden[:, :-1][scored])  # N, V
    per_token = F.cross_entropy(logits.float(), ids[:, 1:][scored], reduction="none")
    is_answer = answer[:, 1:][scored]
    answer_loss = per_token[is_answer].mean() if is_answer.any() else None
    return per_token[~is_answer].mean(), answer_loss


def parameter_groups(neurocache: Neurocache, lr: float, gate_lr: float) -> list[dict[str, Any]]:
    """The gates and slot biases at their own learning rate, every other adapter parameter at `lr`."""
    gates = [p for a in neurocache.cache_attention.values() for p in (a.gate, a.slot_bias)]
    rest = [p for p in neurocache.adapter_parameters() if all(p is not g for g in gates)]
    return [{"params": rest, "lr": lr}, {"params": gates, "lr": gate_lr}]


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        loaded = load_model(config.model, cache_dir=config.cache_dir, device=config.device, dtype="float32")
        self.model, self.tokenizer, self.device = loaded.model, loaded.tokenizer, loaded.device
        self.model.eval()  # the base is frozen: no dropout
        adapter = self.adapter_dir = config.out / loaded.name  # so `longdoc serve --adapter-dir OUT` finds it
        resuming = config.resume and (config.out / "trainer.pt").is_file()
        if resuming:
            self.neurocache = load_adapter(self.model, self.tokenizer, adapter)
        elif config.init_adapter is not None:
            self.neurocache = load_adapter(self.model, self.tokenizer, config.init_adapter)
        else:
            self.neurocache = Neurocache(self.model, config.neurocache)
        self.parameters = list(self.neurocache.adapter_parameters())
        self.optimizer = torch.optim.AdamW(
            parameter_groups(self.neurocache, config.lr, config.gate_lr), betas=(0.9, 0.95), weight_decay=0.0
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, config.warmup, config.steps, config.min_lr_ratio)
        )
        train_files, _ = split(fetch(config.corpus_dir))
        corpus = tokenize_files(self.tokenizer, train_files)
        self.sampler = EpisodeSampler(
            self.tokenizer,
            corpus,
            segment_len=config.segment_len,
            n_segments=config.n_segments,
            passkey_ratio=config.passkey_ratio,
            seed=config.seed,
            distractors=config.distractors,
            repeats=config.repeats,
            fact_ratio=config.fact_ratio,
        )
        capacity = max(self.neurocache.config.capacity, config.segment_len * config.n_segments)
        self.rows = [Row(new_training_cache(self.neurocache, capacity)) for _ in range(config.batch_size)]
        self.step = 0
        self.train_tokens = len(corpus)
        if resuming:
            self._restore(torch.load(config.out / "trainer.pt", weights_only=False))

    # ---- one optimizer step --------------------------------------------------------------

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, answers = [], []
        for row in self.rows:
            if row.episode is None or row.next_segment == self.config.n_segments:
                row.episode, row.next_segment = self.sampler.sample(), 0
                row.document += 1
                row.cache.reset()  # a new document: its cache starts empty
            segment_ids, answer = row.episode.segment(row.next_segment, self.config.segment_len)
            ids.append(segment_ids)
            answers.append(answer)
        return torch.tensor(ids, device=self.device), torch.tensor(answers, device=self.device)

    def _micro_step(self) -> tuple[float, float | None]:
        ids, answers = self._next_batch()
        with training_caches(self.neurocache, [row.cache for row in self.rows]) as shared:
            final = self.model.base_model(input_ids=ids).last_hidden_state  # B, L, h (no LM head yet)
            compressed, hidden = shared.compressed, shared.hidden
        assert compressed is not None and hidden is not None, "the retrieval layer ran"
        lm_loss, answer_loss = segment_loss(self.model, final, ids, answers, self.config.lm_stride)
        loss = lm_loss + (answer_loss if answer_loss is not None else 0.0)
        (loss / self.config.accumulation).backward()
        for index, row in enumerate(self.rows):  # retrieve, attend, then append
            row.cache.add(compressed[index], document=row.document, values=hidden[index])
            row.next_segment += 1
        return float(lm_loss.detach()), None if answer_loss is None else float(answer_loss.detach())

    def train_step(self) -> dict[str, Any]:
        lm, answer = [], []
        for _ in range(self.config.accumulation):
            lm_loss, answer_loss = self._micro_step()
            lm.append(lm_loss)
            if answer_loss is not None:
                answer.append(answer_loss)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, self.config.clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        gates = torch.cat([torch.tanh(cast(CacheAttention, a).gate.detach()) for a in self.neurocache.cache_attention.values()])
        return {
            "step": self.step,
            "lm_loss": sum(lm) / len(lm),
            "answer_loss": sum(answer) / len(answer) if answer else None,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "gate_abs_mean": float(gates.abs().mean()),
        }

    # ---- checkpoints ---------------------------------------------------------------------

    def save(self, **manifest: Any) -> None:
        out = self.config.out
        save_adapter(self.neurocache, self.tokenizer, self.adapter_dir, **manifest)
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler_rng": self.sampler.rng.getstate(),
            "torch_rng": torch.get_rng_state(),
        }
        torch.save(state, out / "trainer.pt")

    def _restore(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.rng.setstate(state["sampler_rng"])
        torch.set_rng_state(state["torch_rng"])


def train(config: TrainConfig, command: str = "") -> list[dict[str, Any]]:
    """Run training to `config.steps`, logging to out/log.jsonl; returns the step records."""
    config.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(config)
    records: list[dict[str, Any]] = []
    started = time.time()
    tokens_per_step = config.batch_size * config.segment_len * config.accumulation
    manifest = {
        "command": command,
        "base_model": config.model,
        "data": f"{config.corpus_dir} training split ({trainer.train_tokens} tokens) + pass-key and fact tasks",
        "seed": config.seed,
        "train_config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items() if k != "neurocache"},
    }
    if config.init_adapter is not None:  # what the starting point was trained with
        manifest["init_manifest"] = read_meta(config.init_adapter).get("manifest", {})
    with (config.out / "log.jsonl").open("a") as log, tqdm(total=config.steps, initial=trainer.step, desc="train") as bar:
        while trainer.step < config.steps:
            record = trainer.train_step()
            record["tokens_per_second"] = tokens_per_step * (len(records) + 1) / (time.time() - started)
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            answer = record["answer_loss"]
            bar.set_postfix(lm=f"{record['lm_loss']:.3f}", ans="-" if answer is None else f"{answer:.3f}")
            bar.update(1)
            if trainer.step % config.checkpoint_every == 0 or trainer.step == config.steps:
                trainer.save(**manifest, steps=trainer.step)
    return records
