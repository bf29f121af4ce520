"""`longdoc train` and `longdoc eval`: the research commands, mounted on the `longdoc` command
through the `longdoc.cli` entry point (pyproject.toml), so the serving CLI never imports research."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from engine.config import DEFAULT_MODEL, SMALL_MODEL


def mount(app: typer.Typer) -> None:
    """Add `train` and `eval` to the `longdoc` command."""
    app.add_typer(train_app, name="train")
    app.add_typer(eval_app, name="eval")


train_app = typer.Typer(help="Train adapters and models.", no_args_is_help=True)


@train_app.command("neurocache")
def train_neurocache(
    out: Annotated[Path, typer.Option(help="run folder: adapter/, trainer.pt, log.jsonl")] = Path("runs/neurocache"),
    model: Annotated[
        str, typer.Option(help="base model: the small one (the shipped adapter's) or a local HF folder")
    ] = SMALL_MODEL,
    steps: Annotated[int, typer.Option(help="optimizer steps")] = 200,
    batch_size: Annotated[int, typer.Option(help="documents per batch")] = 2,
    segment_len: Annotated[int, typer.Option(help="tokens per segment (n)")] = 256,
    n_segments: Annotated[int, typer.Option(help="segments per training document")] = 6,
    accumulation: Annotated[int, typer.Option(help="segments per optimizer step")] = 2,
    lr: Annotated[float, typer.Option(help="peak learning rate")] = 1e-4,
    gate_lr: Annotated[float, typer.Option(help="peak learning rate of the gates and slot biases")] = 1e-2,
    warmup: Annotated[int, typer.Option(help="warm-up steps")] = 20,
    passkey_ratio: Annotated[float, typer.Option(help="share of pass-key episodes")] = 0.5,
    fact_ratio: Annotated[float, typer.Option(help="share of episodes with a fact in prose and a question about it")] = 0.0,
    distractors: Annotated[int, typer.Option(help="at most this many distractor facts per pass-key or fact episode")] = 0,
    repeats: Annotated[float, typer.Option(help="share of pass keys made to hold a digit twice or more")] = 0.0,
    init_adapter: Annotated[
        Path | None, typer.Option(help="fine-tune this adapter (its settings win over the ones below)")
    ] = None,
    top_k: Annotated[int, typer.Option(help="k")] = 16,
    window: Annotated[int, typer.Option(help="w")] = 2,
    context: Annotated[int, typer.Option(help="c")] = 2,
    compression: Annotated[int, typer.Option(help="h / d")] = 4,
    lora_rank: Annotated[int, typer.Option(help="LoRA rank")] = 8,
    capacity: Annotated[int, typer.Option(help="cache entries (m) stored with the adapter")] = 16_384,
    successor_bias: Annotated[float, typer.Option(help="initial score bias on each token's nearest match's successor")] = 8.0,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    checkpoint_every: Annotated[int, typer.Option(help="steps between checkpoints")] = 50,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    resume: Annotated[bool, typer.Option(help="continue from out/trainer.pt")] = False,
) -> None:
    """Adapt a frozen model with Neurocache (W_p, cache attention, gates, FFN LoRA)."""
    from engine.memories.neurocache.adapter import NeurocacheConfig
    from research.training.neurocache_train import TrainConfig, train

    config = TrainConfig(
        model=model,
        out=out,
        device=device,
        steps=steps,
        batch_size=batch_size,
        segment_len=segment_len,
        n_segments=n_segments,
        accumulation=accumulation,
        lr=lr,
        gate_lr=gate_lr,
        warmup=warmup,
        passkey_ratio=passkey_ratio,
        fact_ratio=fact_ratio,
        seed=seed,
        checkpoint_every=checkpoint_every,
        resume=resume,
        distractors=distractors,
        repeats=repeats,
        init_adapter=init_adapter,
        neurocache=NeurocacheConfig(
            top_k=top_k,
            window=window,
            context=context,
            compression=compression,
            lora_rank=lora_rank,
            capacity=capacity,
            successor_bias=successor_bias,
        ),
    )
    records = train(config, command="longdoc train neurocache " + " ".join(sys.argv[3:]))
    if records:
        last = records[-1]
        typer.echo(f"step {last['step']}: lm loss {last['lm_loss']:.4f}, answer loss {last['answer_loss']}")


@train_app.command("lm")
def train_lm_command(
    arch: Annotated[
        str, typer.Option(help="transformer, long-short, cacheformer, segment-cache, perceiver-ar[-v1|-v2|-v3] or llp")
    ] = "cacheformer",
    out: Annotated[Path, typer.Option(help="run folder")] = Path("runs/lm"),
    steps: int = 1000,
    batch_size: int = 8,
    seq_len: Annotated[int, typer.Option(help="training sequence length (bytes)")] = 512,
    lr: float = 1e-3,
    warmup: int = 50,
    seed: int = 0,
    dim: int = 128,
    layers: int = 4,
    heads: int = 4,
    window: Annotated[int, typer.Option(help="w")] = 64,
    segment_len: Annotated[int, typer.Option(help="l")] = 16,
    compressed: Annotated[int, typer.Option(help="r per segment")] = 4,
    overlap: Annotated[bool, typer.Option(help="overlapping segments")] = False,
    cache_top_k: Annotated[int, typer.Option(help="k (cacheformer: 0 is no cache attention; segment-cache needs 1 to N)")] = 0,
    cache_neighbours: Annotated[int, typer.Option(help="u")] = 1,
    group_size: Annotated[int, typer.Option(help="p")] = 32,
    latent: Annotated[int, typer.Option(help="Perceiver AR: latent length")] = 128,
    history_segment: Annotated[int, typer.Option(help="perceiver-ar-v2: history segment")] = 64,
    history_compressed: Annotated[int, typer.Option(help="perceiver-ar-v3: compressed history length")] = 32,
    memory_len: Annotated[int, typer.Option(help="segment-cache: short-term memory m")] = 64,
    cache_segments: Annotated[int, typer.Option(help="segment-cache: cached segments N")] = 8,
    eval_scored: Annotated[
        int | None,
        typer.Option(help="held-out: score the last n positions of windows every n bytes (same bytes for every family)"),
    ] = None,
    device: str = "auto",
    resume: bool = False,
    init: Annotated[
        Path | None, typer.Option(help="start from this checkpoint folder; its model settings replace the flags above")
    ] = None,
    checkpoint_every: Annotated[int, typer.Option(help="steps between checkpoints")] = 200,
) -> None:
    """Train a byte-level model on the offline corpus (from scratch, or on from --init); prints the held-out summary."""
    import json

    from research.training.lm_train import LMTrainConfig, default_model_config, train_lm

    model = default_model_config(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        window=window,
        segment_len=segment_len,
        compressed_per_segment=compressed,
        overlap=overlap,
        cache_top_k=cache_top_k,
        cache_neighbours=cache_neighbours,
        group_size=group_size,
        latent=latent,
        history_segment=history_segment,
        history_compressed=history_compressed,
        memory_len=memory_len,
        cache_segments=cache_segments,
        max_seq_len=seq_len,
    )
    config = LMTrainConfig(
        arch=arch,
        model=model,
        out=out,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        warmup=warmup,
        seed=seed,
        device=device,
        resume=resume,
        init=init,
        checkpoint_every=checkpoint_every,
        eval_scored=eval_scored,
    )
    typer.echo(json.dumps(train_lm(config, command="longdoc train lm " + " ".join(sys.argv[3:])), indent=2))


eval_app = typer.Typer(help="Evaluate memories on held-out text; tables are printed as Markdown.", no_args_is_help=True)
AdapterOption = Annotated[Path | None, typer.Option(help="adapter folder (default: the shipped one)")]


QuantizeOption = Annotated[
    str, typer.Option(help="auto (the server's default), none, bf16, int8 or int4: weight-only, as longdoc serve --quantize")
]


EmbedderAdapterOption = Annotated[
    str, typer.Option(help="the text memory's MiniLM adapter, as longdoc serve --embedder-adapter: shipped, none or a folder")
]


def _setup(model: str, adapter: Path | None, device: str, quantize: str = "auto", embedder_adapter: str = "shipped"):
    from engine.config import embedder_adapter_path
    from research.training.evaluate import EvalSetup

    try:
        embedder = embedder_adapter_path(embedder_adapter)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    return EvalSetup(model=model, adapter=adapter, device=device, quantize=quantize, embedder_adapter=embedder)


@eval_app.command("ppl")
def eval_ppl(
    model: str = SMALL_MODEL,
    adapter: AdapterOption = None,
    segment_len: Annotated[int, typer.Option(help="n")] = 1024,
    capacity: Annotated[list[int], typer.Option(help="cache sizes m")] = [16_384, 131_072],
    max_tokens: Annotated[int, typer.Option(help="tokens per held-out document")] = 32_768,
    device: str = "auto",
) -> None:
    """Held-out perplexity: local window only, full attention reference, and Neurocache."""
    from research.training.evaluate import markdown, perplexity

    rows = perplexity(_setup(model, adapter, device), segment_len=segment_len, capacities=tuple(capacity), max_tokens=max_tokens)
    typer.echo(markdown(rows))


CapacityOption = Annotated[int | None, typer.Option(help="m of neurocache sessions (default: the adapter's)")]


@eval_app.command("passkey")
def eval_passkey(
    model: str = SMALL_MODEL,  # its default memories include neurocache, whose adapter is for SmolLM2
    adapter: AdapterOption = None,
    memory: Annotated[
        list[str], typer.Option(help="memories to compare, each maybe with its JSON options: 'kvcache {\"top_k\": 16}'")
    ] = ["truncate", "text", "neurocache"],
    length: Annotated[list[int], typer.Option(help="document lengths in tokens")] = [4096, 16_384],
    depth: Annotated[list[float], typer.Option(help="where the key is, 0..1")] = [0.1, 0.3, 0.5, 0.7, 0.9],
    capacity: CapacityOption = None,
    seed: Annotated[int, typer.Option(help="seed of the keys drawn, one per trial in order")] = 0,
    device: str = "auto",
    embedder_adapter: EmbedderAdapterOption = "shipped",
) -> None:
    """Pass-key retrieval accuracy by memory and document length."""
    from research.training.evaluate import markdown, passkey

    rows = passkey(
        _setup(model, adapter, device, embedder_adapter=embedder_adapter),
        memories=tuple(_memory_runs(memory)),
        lengths=tuple(length),
        depths=tuple(depth),
        capacity=capacity,
        seed=seed,
    )
    typer.echo(markdown(rows))


def _memory_runs(memory: list[str]) -> list[tuple[str, dict]]:
    """'text {"top_k": 2}' -> ("text", {"top_k": 2}); a bare name has no options."""
    return [(m.split(" ", 1)[0], json.loads(m.split(" ", 1)[1]) if " " in m else {}) for m in memory]


def _echo_rows(rows: list) -> None:
    from research.evals.qa import table

    typer.echo(table(rows))
    for row in rows:
        typer.echo(f"{row.memory} {row.options or ''} missed: " + "; ".join(row.missed))


@eval_app.command("qa")
def eval_qa(
    model: str = DEFAULT_MODEL,
    adapter: AdapterOption = None,
    memory: Annotated[
        list[str],
        typer.Option(
            help='a memory, "oracle" (the gold passage alone), or a memory and its JSON options: \'text {"retrieval": "dense"}\''
        ),
    ] = ["oracle", "text", "truncate"],
    limit: Annotated[int | None, typer.Option(help="ask only the first N questions of each text")] = None,
    dev: Annotated[
        bool, typer.Option(help="the development questions (research/evals/qa_dev.jsonl), to choose settings on")
    ] = False,
    device: str = "auto",
    quantize: QuantizeOption = "auto",
    embedder_adapter: EmbedderAdapterOption = "shipped",
    write: Annotated[
        Path | None, typer.Option(help="also write the table into this Markdown file (docs/studies/retrieval.md)")
    ] = None,
) -> None:
    """The QA benchmark: 110 questions about five held-out texts (with --dev, 120 development ones), per memory, with the oracle row."""
    from research.evals.qa import DEV_QUESTIONS, QUESTIONS, bench, section

    if dev and write:
        raise typer.BadParameter("--write records the held-out questions' table; a --dev run is only printed")
    runs = _memory_runs(memory)
    questions = DEV_QUESTIONS if dev else QUESTIONS
    rows = bench(_setup(model, adapter, device, quantize, embedder_adapter), runs, limit=limit, questions_path=questions)
    _echo_rows(rows)
    if write:
        from research.evals.docs import write_section

        given = sys.argv[3:]  # the section names the model even where the command left it to the default
        named = given if any(a == "--model" or a.startswith("--model=") for a in given) else ["--model", model, *given]
        write_section(write, section(rows, "longdoc eval qa " + shlex.join(named)))


@eval_app.command("wholedoc")
def eval_wholedoc(
    model: str = DEFAULT_MODEL,
    memory: Annotated[
        list[str], typer.Option(help='a memory, "oracle" (the fact passages alone, in order), or a memory and its JSON options')
    ] = ["oracle", "text", "truncate"],
    length: Annotated[list[int], typer.Option(help="document length in tokens (about); repeat")] = [32768],
    dev: Annotated[bool, typer.Option(help="the development seeds and filler, to choose settings on")] = False,
    seeds: Annotated[int | None, typer.Option(help="only the first N seeds")] = None,
    seed: Annotated[
        list[int], typer.Option(help="these seeds instead (repeat; with the held-out filler unless --dev): fresh records")
    ] = [],
    phrasing: Annotated[
        str, typer.Option(help='the questions\' words: "shipped", "reworded" (to choose on) or "unseen" (held out only)')
    ] = "shipped",
    device: str = "auto",
    quantize: QuantizeOption = "auto",
    embedder_adapter: EmbedderAdapterOption = "shipped",
) -> None:
    """Whole-document questions (counts, lists, first/last, comparisons, two hops, order, look-alikes)
    over generated records in book-length filler: per memory and per kind, beside the oracle."""
    from research.evals import wholedoc

    if set(seed) & set(wholedoc.DEV_SEEDS) and not dev:
        raise typer.BadParameter(f"seeds {wholedoc.DEV_SEEDS} are the development ones: pass --dev with them")
    if set(seed) & set(wholedoc.HELD_OUT_SEEDS) and dev:
        raise typer.BadParameter(f"seeds {wholedoc.HELD_OUT_SEEDS} are held out: not with --dev")
    if phrasing not in ("shipped", *wholedoc.PHRASINGS):
        raise typer.BadParameter(f"phrasing: shipped or one of {sorted(wholedoc.PHRASINGS)}")
    if phrasing == "unseen" and dev:
        raise typer.BadParameter("the unseen phrasings are for held-out figures only: choose settings on --phrasing reworded")
    chosen = tuple(seed) or (wholedoc.DEV_SEEDS if dev else wholedoc.HELD_OUT_SEEDS)
    fillers = wholedoc.DEV_FILLER if dev else wholedoc.HELD_OUT_FILLER
    docs = wholedoc.documents(chosen[:seeds] if seeds else chosen, tuple(length), fillers, phrasing=phrasing)
    rows = wholedoc.bench(_setup(model, None, device, quantize, embedder_adapter), _memory_runs(memory), docs)
    _echo_rows(rows)


@eval_app.command("wholebook")
def eval_wholebook(
    model: str = DEFAULT_MODEL,
    memory: Annotated[
        list[str],
        typer.Option(help='a memory, "oracle" (the evidence passages alone, in order), or a memory and its JSON options'),
    ] = ["oracle", "text", "truncate"],
    device: str = "auto",
    quantize: QuantizeOption = "auto",
    embedder_adapter: EmbedderAdapterOption = "shipped",
    dev: Annotated[bool, typer.Option(help="the 24 development questions (research/evals/wholebook_dev.jsonl) instead")] = False,
) -> None:
    """Hand-written whole-book questions about three held-out texts (research/evals/wholebook.jsonl), per memory, beside the oracle."""
    from research.evals import wholebook, wholedoc

    questions = wholebook.DEV_QUESTIONS if dev else wholebook.QUESTIONS
    rows = wholedoc.bench(
        _setup(model, None, device, quantize, embedder_adapter), _memory_runs(memory), wholebook.load(questions)
    )
    _echo_rows(rows)


@eval_app.command("needles")
def eval_needles(
    model: str = DEFAULT_MODEL,
    adapter: AdapterOption = None,
    memory: Annotated[list[str], typer.Option(help="a memory, or a memory and its JSON options")] = ["text"],
    length: Annotated[list[int], typer.Option(help="document lengths in tokens")] = [8192, 32768, 131072],
    seeds: Annotated[int, typer.Option(help="documents per length, each with six needles")] = 3,
    device: str = "auto",
    quantize: QuantizeOption = "auto",
    embedder_adapter: EmbedderAdapterOption = "shipped",
) -> None:
    """Invented facts of six kinds placed in held-out filler, asked about per memory and length."""
    from research.evals.needles import bench

    runs = _memory_runs(memory)
    rows = bench(_setup(model, adapter, device, quantize, embedder_adapter), runs, list(length), seeds)
    _echo_rows(rows)


@eval_app.command("ranks")
def eval_ranks(
    model: str = DEFAULT_MODEL,
    memory: Annotated[list[str], typer.Option(help='text, maybe with its JSON options: \'text {"fusion": "rank"}\'')] = ["text"],
    dev: Annotated[bool, typer.Option(help="the development questions, not the held-out QA ones")] = False,
    needles: Annotated[int | None, typer.Option(help="the fact needles in documents of this many tokens, not questions")] = None,
    seeds: Annotated[int, typer.Option(help="needle documents, each with six needles")] = 3,
    device: str = "auto",
    embedder_adapter: EmbedderAdapterOption = "shipped",
    margin: Annotated[list[float], typer.Option(help="also: what text's margin would take of the first top_k")] = [],
) -> None:
    """Where the gold passage ranks in text retrieval, no answers generated: recall@1-16 per setting."""
    from research.evals.qa import DEV_QUESTIONS, QUESTIONS, table
    from research.evals.ranks import bench
    from research.training.evaluate import markdown

    runs = _memory_runs(memory)
    if any(kind != "text" for kind, _ in runs):
        raise typer.BadParameter("ranks measures the text memory only")
    questions = None if needles else DEV_QUESTIONS if dev else QUESTIONS
    rows = bench(
        _setup(model, None, device, embedder_adapter=embedder_adapter),
        [options for _, options in runs],
        questions_path=questions,
        length=needles or 0,
        seeds=seeds,
    )
    typer.echo(table(rows))
    if margin:
        typer.echo(markdown([row.with_margin(m) for row in rows for m in margin]))


@eval_app.command("lm")
def eval_lm(
    checkpoint: Annotated[Path, typer.Argument(help="a checkpoint folder (config.json + model.safetensors)")],
    max_bytes: Annotated[int, typer.Option(help="held-out bytes to score")] = 262_144,
    device: str = "cpu",
) -> None:
    """Held-out bits per byte of a from-scratch checkpoint."""
    from research.training.lm_train import bits_per_byte, corpus_bytes, load_checkpoint

    model = load_checkpoint(checkpoint, device)
    _, held_out = corpus_bytes(Path("data/corpus"))
    bpb = bits_per_byte(model, held_out, model.config.max_seq_len, max_bytes)
    typer.echo(f"{checkpoint}: {model.arch}, {model.num_parameters()} parameters, held-out {bpb:.4f} bits/byte")
