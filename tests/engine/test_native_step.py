"""The batched decode step in C (engine/models/native_step.py): it is used where it computes what
the model's modules do, its logits equal the model's over each row's whole sequence, it writes the
keys and values the torch step writes, a row's logits do not depend on the rows beside it, and a
model it cannot step gets the torch step. (int4 on inputs rounded to int8: within a tenth of
the torch step's logits, its rounding being the kernel's, tests/engine/test_cpu_kernels.py.)"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import Any, cast

import pytest
import torch
from transformers import DynamicCache

from engine.interface import GenerationParams
from engine.memories.kvcache.select import SelectConfig, SelectiveAnswer, SelectiveModel
from engine.memories.kvcache.store import KVStore
from engine.memories.neurocache.adapter import Neurocache, NeurocacheConfig
from engine.models import cpu_kernels
from engine.models.llama_step import BatchDecoder, Row, _step_parts, native_step
from engine.models.native_step import NativeStep
from engine.models.quantize import DECODE_ROWS, quantize_linears
from engine.runtime.generation import AnswerState
from research.lms.byte_tokenizer import ByteTokenizer
from tests.engine.test_batching import FAMILIES, NO_STOP, alone, batcher_for, collect, requests, same_answer, tiny
from tests.engine.test_cpu_kernels import BUILDABLE
from tests.helpers import TEST_DEVICE, int4_rounds_inputs

pytestmark = [
    pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the C step is for CPU"),
    pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU"),  # where they are, the kernels must build
]
VOCAB = 101


def model_of(family: str = "llama", vocab: int = VOCAB, **overrides: Any) -> Any:
    """A tiny model the C step takes: head_dim 16, features multiples of 32."""
    return tiny(family, vocab, **{"hidden_size": 64, "intermediate_size": 96, **overrides})


def rows_of(decoder: BatchDecoder, lengths: list[int], seed: int = 2) -> list[Row]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        prompt = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        row = Row(prompt, GenerationParams(max_tokens=8))
        row.state = AnswerState(ByteTokenizer(), prompt, row.params, NO_STOP)  # type: ignore[arg-type]
        decoder.prefill(row)
        rows.append(row)
    return rows


def feed(rows: list[Row], tokens: list[int]) -> None:
    for row, token in zip(rows, tokens, strict=True):
        assert row.state is not None
        row.state.next_token = token
        row.prompt_ids = [*row.prompt_ids, token]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("mode", ["none", "bf16", "int8", "int4"])
def test_steps_equal_the_model_over_each_whole_sequence(family, mode, kernel_set):
    if (mode == "int4" and kernel_set in ("avx2_int8", "vnni")) or (mode == "int8" and kernel_set == "vnni"):
        pytest.skip(f"{mode} on int8 inputs: the model's prompt passes (float32) round no inputs; the torch step's test")
    model = model_of(family)
    quantize_linears(model, mode)
    decoder = BatchDecoder(model)
    assert decoder.native is not None and decoder.rows_alone
    rows = rows_of(decoder, [5, 30, 12])
    generator = torch.Generator().manual_seed(3)
    for _ in range(6):
        feed(rows, torch.randint(0, VOCAB, (len(rows),), generator=generator).tolist())
        logits = decoder.step(rows)
        for i, row in enumerate(rows):
            with torch.no_grad():  # the same weights, through the model's modules (prefill rows: float32)
                full = model(input_ids=torch.tensor([row.prompt_ids])).logits[0, -1]
            torch.testing.assert_close(logits[i], full, rtol=1e-4, atol=1e-4)
    assert all(row.length == len(row.prompt_ids) for row in rows)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_bfloat16_model_steps_as_its_weights_widened_to_float32(family):
    """A bf16 model's C step reads its weights in bf16 (no copy) and computes in float32: the
    same logits and keys as the C step of a float32 model holding those weights widened."""
    bf16 = model_of(family, attention_bias=True).to(torch.bfloat16)
    with torch.no_grad():
        for name, parameter in bf16.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.3)  # zero at init: make them count (Qwen2's q/k/v biases)
    widened = copy.deepcopy(bf16).to(torch.float32)
    low, wide = BatchDecoder(bf16), BatchDecoder(widened)
    assert low.native is not None and low.cache_dtype == torch.float32
    rows, twins = steps_alike(low, wide)
    for a, b in zip(rows, twins, strict=True):
        assert a.keys is not None and b.keys is not None
        torch.testing.assert_close(b.keys[:, :, : b.length], a.keys[:, :, : a.length], rtol=1e-5, atol=1e-5)


def steps_alike(low: BatchDecoder, wide: BatchDecoder) -> tuple[list[Row], list[Row]]:
    """The same two rows stepped by both decoders, three steps of two answers: the logits agree
    within 1e-4 at each; returns (`wide`'s rows, `low`'s)."""
    rows = rows_of(wide, [13, 5])
    twins = copy.deepcopy(rows)
    for token in (9, 51, 2):
        feed(rows, [token, token])
        feed(twins, [token, token])
        torch.testing.assert_close(low.step(twins), wide.step(rows), rtol=1e-4, atol=1e-4)
    return rows, twins


def assert_plain_keys(plain: Any, row: Row, parts: list[int]) -> None:
    """Every layer's keys and values in `row` are the plain model's fed the same parts (bf16
    rounding depends on a pass's rows)."""
    cache, at = DynamicCache(), 0
    with torch.no_grad():
        for size in parts:
            plain(input_ids=torch.tensor([row.prompt_ids[at : at + size]]), past_key_values=cache, use_cache=True)
            at += size
    assert row.keys is not None and row.values is not None and at == len(row.prompt_ids)
    for layer, kept in enumerate(cache.layers):
        keys, values = cast(Any, kept).keys, cast(Any, kept).values  # a full-attention layer's
        torch.testing.assert_close(row.keys[layer, :, :at], keys[0].float(), rtol=0, atol=0)
        torch.testing.assert_close(row.values[layer, :, :at], values[0].float(), rtol=0, atol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_int8_over_a_bfloat16_model_prefills_in_bfloat16_and_steps_from_int8(tied):
    """`--quantize int8` on a bf16 model (its head tied to the embedding or not): its prompt runs
    through the bf16 weights (every layer's keys and values are the plain bf16 model's, the prompt
    fed in parts whose short tail joins the part before, and parts asked of DECODE_ROWS tokens or
    fewer made longer), and its steps are those of a float32 model holding the same int8 weights
    (int8 of a bf16 weight is int8 of it widened)."""
    bf16 = model_of(attention_bias=True, tie_word_embeddings=tied).to(torch.bfloat16)
    plain = copy.deepcopy(bf16)
    widened = copy.deepcopy(bf16).to(torch.float32)
    quantize_linears(bf16, "int8")
    quantize_linears(widened, "int8")
    if tied:  # the head's bf16 weight is the embedding itself, not a copy
        assert bf16.lm_head.weight_full.data_ptr() == bf16.model.embed_tokens.weight.data_ptr()
    low, wide = BatchDecoder(bf16), BatchDecoder(widened)
    assert low.native is not None and low.rows_alone and low.whole_tail and not wide.whole_tail
    prefilled = Row(
        torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(4)).tolist(), GenerationParams(max_tokens=8)
    )
    assert low.prefill_part(prefilled, 20) is None and prefilled.fed == 20
    assert low.prefill_part(prefilled, 20) is not None  # 40 of 45: the last 5 came with them
    short = Row(prefilled.prompt_ids, GenerationParams(max_tokens=8))
    assert low.prefill_part(short, 8) is None and short.fed == DECODE_ROWS + 1  # parts of 8 asked: 17, the fewest over bf16
    assert low.prefill_part(short, 8) is not None  # 34 of 45, then the last 11 with them
    assert short.keys is not None
    assert_plain_keys(plain, short, [17, 28])
    assert_plain_keys(plain, prefilled, [20, 25])
    steps_alike(low, wide)


def test_a_bfloat16_model_prefills_in_bfloat16_and_keeps_float32_keys():
    """Its prompt runs through the bf16 modules; the row's keys and values are theirs, widened,
    and the first step's logits are the bf16 model's over the whole sequence, up to bf16 rounding."""
    model = model_of().to(torch.bfloat16)
    decoder = BatchDecoder(model)
    (row,) = rows_of(decoder, [17])
    assert row.keys is not None and row.keys.dtype == torch.float32
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([row.prompt_ids]), use_cache=True).past_key_values
    torch.testing.assert_close(row.keys[0, :, :17], cache.layers[0].keys[0].float(), rtol=0, atol=0)
    feed([row], [33])
    logits = decoder.step([row])[0]
    with torch.no_grad():
        full = model(input_ids=torch.tensor([row.prompt_ids])).logits[0, -1].float()
    assert (logits - full).abs().max() < 0.05 * full.abs().max()  # bf16 rounds between operations; the C step does not
    assert logits.argmax() == full.argmax()


@pytest.mark.parametrize(
    "change",
    [
        {"attention_bias": True, "mlp_bias": True},  # biases on q/k/v, o, gate/up and down
        {"tie_word_embeddings": True},  # the head is the embedding (the default model's)
        {"num_key_value_heads": 4},  # one query head a key/value head
        {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2},  # four
        {"head_dim": 32},  # attention 128 wide on a 64-wide model
    ],
    ids=["biases", "tied-head", "group-1", "group-4", "wide-heads"],
)
def test_other_llama_shapes_equal_the_model(change):
    model = model_of(**change)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.3)  # zero at init: make them count
    decoder = BatchDecoder(model)
    assert decoder.native is not None
    rows = rows_of(decoder, [11, 4])
    for token in (3, 77):
        feed(rows, [token, token])
        logits = decoder.step(rows)
        for i, row in enumerate(rows):
            with torch.no_grad():
                full = model(input_ids=torch.tensor([row.prompt_ids])).logits[0, -1]
            torch.testing.assert_close(logits[i], full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_it_writes_the_keys_and_values_the_torch_step_writes(mode, kernel_set):
    """Both steps' decode rows go through the same matmul kernels; the rest sums in other orders
    (int4's keys to 1e-4). int4 on int8 inputs (and int8 on them, with AVX-512 VNNI) rounds each matmul's inputs, which turns those
    1e-5 differences into whole rounding steps here and there: there the logits agree to a tenth of
    their largest and the prompt's keys (fed alike, in float32) to 1e-4."""
    model = model_of("qwen2")
    quantize_linears(model, mode)
    native, torch_step = BatchDecoder(model), BatchDecoder(model)
    torch_step.native = None
    rounded = (mode == "int4" and int4_rounds_inputs()) or (mode == "int8" and cpu_kernels.int8_rounds_inputs())
    lengths = [DECODE_ROWS + 3, 21]  # prompt passes over DECODE_ROWS rows: both feed them alike (float32)
    pairs = rows_of(native, lengths), rows_of(torch_step, lengths)
    for token in (7, 40, 3):
        for rows in pairs:
            feed(rows, [token, token])
        a, b = native.step(pairs[0]), torch_step.step(pairs[1])
        if rounded:
            assert (a - b).abs().max() < 0.1 * b.abs().max()
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for x, y in zip(*pairs, strict=True):
        assert x.length == y.length == len(x.prompt_ids)
        assert x.keys is not None and y.keys is not None and x.values is not None and y.values is not None
        close = 1e-4 if mode == "int4" else 1e-5
        upto = x.length - 3 if rounded else x.length  # the last 3: written by the steps
        torch.testing.assert_close(x.keys[:, :, :upto], y.keys[:, :, :upto], rtol=close, atol=close)
        torch.testing.assert_close(x.values[:, :, :upto], y.values[:, :, :upto], rtol=close, atol=close)
        assert not torch.equal(x.keys[:, :, x.length - 1], torch.zeros_like(x.keys[:, :, 0]))


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_a_row_gets_the_same_logits_in_any_company_without_padding(mode, kernel_set):
    model = model_of()
    quantize_linears(model, mode)
    decoder = BatchDecoder(model)
    assert [decoder.step_rows(n) for n in (1, 2, 3, 5, 20)] == [1, 2, 3, 5, 20]
    lone, pair, six = (rows_of(decoder, lengths) for lengths in ([20], [20, 7], [20, 7, 33, 12, 25, 9]))
    for token in (5, 17, 60):
        for rows in (lone, pair, six):
            feed(rows, [token] * len(rows))
        reference = decoder.step(lone)[0]
        assert torch.equal(decoder.step(pair)[0], reference)
        assert torch.equal(decoder.step(six)[0], reference)


def test_answers_through_the_batcher_are_the_answers_alone(tiny_tokenizer):
    model = model_of(vocab=len(tiny_tokenizer))
    assert BatchDecoder(model).native is not None
    work = requests(len(tiny_tokenizer))
    expected = [alone(model, tiny_tokenizer, prompt, params) for prompt, params in work]
    batcher = batcher_for(model, tiny_tokenizer)

    async def run():
        return await asyncio.gather(*(collect(batcher, prompt, params) for prompt, params in work))

    for a, b in zip(asyncio.run(run()), expected, strict=True):
        assert same_answer(a, b), (a, b)


def test_a_neurocache_adapted_model_is_stepped_by_its_base_layers():
    """The default model is served with its adapter attached; a batched step (never inside a
    Neurocache binding) runs the base layers, as the model's modules do there."""
    model = model_of()
    neurocache = Neurocache(model, NeurocacheConfig(top_k=4, capacity=64, lora_rank=4, compression=2))
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in neurocache.adapter_parameters():
            parameter.normal_(0, 0.5)  # an open adapter: LoRA would change the FFNs inside a binding
    decoder = BatchDecoder(model)
    assert decoder.native is not None
    rows = rows_of(decoder, [6, 15])
    feed(rows, [4, 9])
    logits = decoder.step(rows)
    for i, row in enumerate(rows):
        with torch.no_grad():
            full = model(input_ids=torch.tensor([row.prompt_ids])).logits[0, -1]
        torch.testing.assert_close(logits[i], full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change",
    [
        {"hidden_act": "gelu"},  # another MLP activation
        {"hidden_size": 48, "num_attention_heads": 4},  # features not a multiple of 32
        {"num_attention_heads": 8, "num_key_value_heads": 2},  # head_dim 8: the C attention reads 16 at a time
    ],
)
def test_a_model_it_would_get_wrong_gets_the_torch_step(change):
    assert BatchDecoder(model_of(**change)).native is None


def test_norms_it_does_not_compute_get_the_torch_step():
    model = model_of()
    model.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-3  # the C step takes one epsilon
    assert BatchDecoder(model).native is None
    model = model_of()
    model.model.norm = torch.nn.LayerNorm(64)
    assert BatchDecoder(model).native is None


def test_without_the_kernels_or_in_another_dtype_the_torch_step(monkeypatch):
    assert BatchDecoder(model_of().to(torch.float64)).native is None
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    decoder = BatchDecoder(model_of())
    assert decoder.native is None and not decoder.rows_alone


CONFIG = SelectConfig(segment_len=8, top_k=2, neighbours=1, window=16, sinks=4, query_chunk=8, reselect_every=3)


def fed_selective(model: Any, config: SelectConfig, native: Any, ids: list[int]) -> tuple[SelectiveModel, KVStore]:
    """A selective model over `model` (C steps with `native`) and its store fed `ids` in chunks of 24."""
    selective = SelectiveModel(model, config, native)
    store = KVStore(selective.store_shape("float32"), device=torch.device("cpu"), dtype=torch.float32)
    store.reserve(len(ids))
    for at in range(0, len(ids), 24):
        selective.feed(store, ids[at : at + 24])
    return selective, store


def count_hooks(selective: SelectiveModel, native: Any, hooked: list[bool]) -> None:
    """`selective`'s C steps go through `native`, noting in `hooked` whether each passed the hook."""

    def step(*args):
        hooked.append(args[4] is not None)
        return native(*args)

    selective.native = step  # type: ignore[assignment]


@pytest.mark.parametrize("family, selection", [("llama", "summary"), ("qwen2", "summary"), ("llama", "keys")])
def test_kvcache_decode_steps_in_c_equal_its_torch_steps(family, selection):
    """kvcache's decode steps run as the C step over its buffers, those that reselect (every 3rd)
    selecting in each layer from the C step's queries; the logits equal its torch steps'."""
    model = model_of(family)
    config = dataclasses.replace(CONFIG, selection=selection)
    ids = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    logits: dict[bool, list[torch.Tensor]] = {}
    picks: dict[bool, list[Any]] = {}
    hooked: list[bool] = []
    for native in (None, native_step(model)):
        selective, store = fed_selective(model, config, native, ids[:120])
        answer = SelectiveAnswer(selective, store, 30)
        assert answer.eligible > 2  # there is something to select, and picks can change
        if native is not None:
            count_hooks(selective, native, hooked)
        logits[native is not None] = [answer.forward(ids[120:130])]
        picks[native is not None] = []
        for token in ids[130:150]:
            logits[native is not None].append(answer.forward([token]))
            picks[native is not None].append(copy.deepcopy(answer._picks))
    assert hooked == [step % 3 == 0 for step in range(20)]  # steps 1, 4, 7, ... reselect
    assert picks[True] == picks[False] and picks[True][0] != picks[True][-1]  # the same picks, and they moved
    for torch_step, c_step in zip(logits[False], logits[True], strict=True):
        torch.testing.assert_close(c_step, torch_step, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kept", ["reselect_every 0", "given picks", "given picks read again"])
def test_kvcache_c_steps_that_keep_the_prompts_picks_never_select(kept):
    """With reselect_every 0, or picks given (selection "text", read again or not), no C step
    passes the hook: every step keeps the prompt pass's picks, and the logits equal the torch steps'."""
    model = model_of("llama")
    change = {"reselect_every": 0, "selection": "keys"} if kept == "reselect_every 0" else {"selection": "text"}
    config = dataclasses.replace(CONFIG, **change)
    ids = torch.randint(0, VOCAB, (136,), generator=torch.Generator().manual_seed(5)).tolist()
    picks = None if kept == "reselect_every 0" else [1, 3]
    pick_tokens = ids[12:20] + ids[28:36] if kept == "given picks read again" else None  # segments 1 and 3 after 4 sinks
    logits: list[torch.Tensor] = []
    hooked: list[bool] = []
    for native in (None, native_step(model)):
        selective, store = fed_selective(model, config, native, ids[:120])
        answer = SelectiveAnswer(selective, store, 16, picks, pick_tokens)
        if native is not None:
            count_hooks(selective, native, hooked)
        out = [answer.forward(ids[120:128])]
        prompt_picks = copy.deepcopy(answer._picks)
        out += [answer.forward([token]) for token in ids[128:136]]
        assert answer._picks == prompt_picks
        logits.append(torch.stack(out))
    assert hooked == [False] * 8
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_kvcache_over_a_bfloat16_model_decodes_as_its_weights_widened():
    """A bf16 model's kvcache answer: the prompt pass in bf16 (torch) into float32 buffers, then
    decode steps in C, reselecting every third step. From the same prompt pass, they equal the
    torch steps of the float32 model holding the same weights widened (same picks, logits 1e-4)."""
    model = model_of().to(torch.bfloat16)
    widened = SelectiveModel(copy.deepcopy(model).to(torch.float32), CONFIG)
    ids = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    selective = SelectiveModel(model, CONFIG, native_step(model))
    store = KVStore(selective.store_shape("bfloat16"), device=torch.device("cpu"), dtype=torch.bfloat16)
    store.reserve(120)
    for at in range(0, 120, 24):
        selective.feed(store, ids[at : at + 24])
    answers = [SelectiveAnswer(selective, store, 30) for _ in range(2)]
    assert answers[0].keys.dtype == torch.float32 and answers[0].eligible > 2
    prompt = [answer.forward(ids[120:130]) for answer in answers]
    assert torch.equal(prompt[0], prompt[1])
    answers[1].m = widened  # from here on: torch steps in float32 over the widened weights
    picks = []
    for token in ids[130:150]:
        c_step, torch_step = (answer.forward([token]) for answer in answers)
        torch.testing.assert_close(c_step, torch_step, rtol=1e-4, atol=1e-4)
        assert answers[0]._picks == answers[1]._picks
        picks.append(copy.deepcopy(answers[0]._picks))
    assert picks[0] != picks[-1]  # reselection happened and moved


def test_an_exception_in_the_hook_skips_the_later_hooks_and_is_raised():
    decoder = BatchDecoder(model_of())
    (row,) = rows_of(decoder, [6])
    seen = []

    def hook(layer, qkv):
        seen.append((layer, tuple(qkv.shape)))
        raise RuntimeError("selection failed")

    hidden, cos, sin = torch.zeros(1, 64), torch.ones(1, 16), torch.zeros(1, 16)
    assert decoder.native is not None
    with pytest.raises(RuntimeError, match="selection failed"):
        decoder.native(hidden, [row], cos, sin, hook)
    assert seen == [(0, (1, (4 + 2 * 2) * 16))]  # called in the first layer, not again


def test_kvcache_gets_no_c_step_where_the_batched_step_would_not_run():
    assert native_step(model_of()) is not None
    model = model_of("qwen3", head_dim=16).eval()
    assert native_step(model) is None  # not a batched family
    assert NativeStep.build(model, *_step_parts(model)) is None  # and its per-head q/k norms are not computed in C
