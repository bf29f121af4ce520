"""Weight-only quantization (`--quantize bf16|int8|int4`, engine/models/quantize.py): each layer against
the float32 layer it replaces, a whole model's logits, which layers are converted, and the server
flag with its refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn
from transformers import AutoModelForCausalLM

from engine.config import DEFAULT_MODEL, ModelSpec
from engine.models import cpu_kernels, quantize
from engine.models import manifest as manifests
from engine.models.loader import LoadedModel
from engine.models.quantize import DECODE_ROWS, WeightOnlyLinear, quantize_linears
from engine.runtime import registry
from engine.runtime.registry import quantize_mode
from tests.engine.test_cpu_kernels import BUILDABLE
from tests.helpers import TEST_DEVICE, int4_inputs, int4_parts, int4_product, int8_inputs, tiny_settings

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="weight-only quantization is for CPU")
MODES = ("bf16", "int8")


def linear(seed: int = 0, bias: bool = False) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(96, 160, bias=bias)


def weight_tolerance(weight: torch.Tensor, mode: str) -> torch.Tensor:
    """How far a stored weight may be from the float32 one: half an int8 step of its row's scale, or
    bfloat16's rounding (8 bits of mantissa)."""
    if mode == "int8":
        return (weight.abs().amax(dim=1, keepdim=True) / 254 * 1.001).expand_as(weight)
    return weight.abs() * 2**-8


@pytest.fixture(params=["longdoc", "torch"])
def decode_kernel(request, monkeypatch):
    """Decode rows through longdoc's kernel (engine/models/cpu_kernels.py) or, as where it cannot be
    built, torch's."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    elif not BUILDABLE:
        pytest.skip("longdoc's CPU kernels need cc and an AVX2 CPU")
    else:
        assert cpu_kernels.library() is not None, "cc and AVX2 are here: the kernels must build"
    return request.param


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 3, DECODE_ROWS, DECODE_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_stays_within_its_rounding_of_float32(mode, rows, bias, decode_kernel):
    plain = linear(bias=bias)
    quantized = WeightOnlyLinear(plain, mode)
    x = torch.randn(rows, 96)
    # longdoc's int8 kernel on a CPU with AVX-512 VNNI multiplies the inputs rounded to int8
    inputs = int8_inputs(x) if mode == "int8" and rows <= DECODE_ROWS and decode_kernel == "longdoc" else x.double()
    with torch.no_grad():
        want, got = plain(x), quantized(x)
        tolerance = weight_tolerance(plain.weight, mode)
        assert ((quantized.dequantized() - plain.weight).abs() <= tolerance).all()
        if rows <= DECODE_ROWS and decode_kernel == "torch":  # torch's decode kernels round the inputs to bfloat16
            tolerance = tolerance + plain.weight.abs() * 2**-8
        rounding = ((inputs - x.double()).abs() @ quantized.dequantized().double().abs().T).float()
        bound = x.abs() @ tolerance.T + rounding + 1e-4
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got - want).abs() <= bound).all()
    if rows > DECODE_ROWS:  # a prefill runs float32 on the widened weight: exactly that matmul
        torch.testing.assert_close(got, F.linear(x, quantized.dequantized(), plain.bias), rtol=0, atol=0)
    elif decode_kernel == "longdoc":  # the stored weight times the float32 input (or int8's rounding of it), summed in float32
        exact = F.linear(inputs, quantized.dequantized().double()).float()
        torch.testing.assert_close(got - (0 if plain.bias is None else plain.bias), exact, rtol=1e-5, atol=1e-5)
    else:  # a decode row: the stored weight (int8: its scales in bfloat16) times the bfloat16 input, summed in
        # float32, the result rounded to bfloat16
        weight = quantized.dequantized()
        if mode == "int8":
            weight = quantized.weight_low.float() * quantized.scales.to(torch.bfloat16).float()[:, None]
        exact = F.linear(x.to(torch.bfloat16).float(), weight)
        torch.testing.assert_close(got - (0 if plain.bias is None else plain.bias), exact, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("in_features", [8, 24, 40])
def test_int8_rows_of_other_lengths_stay_right_call_after_call(in_features, monkeypatch):
    """Where neither longdoc's kernel nor torch's int8 kernel takes the rows (torch's returned
    garbage on an AVX-512 CPU for these lengths, from the first call on), the layer still gives the
    stored weight times the bfloat16 input, every call."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    torch.manual_seed(0)
    quantized = WeightOnlyLinear(nn.Linear(in_features, 16, bias=False), "int8")
    weight = quantized.weight_low.float() * quantized.scales.to(torch.bfloat16).float()[:, None]
    for rows in (1, 3, 1, 3):
        x = torch.randn(rows, in_features)
        with torch.no_grad():
            got = quantized(x)
        torch.testing.assert_close(got, F.linear(x.to(torch.bfloat16).float(), weight), rtol=2**-7, atol=1e-3)


def test_int8_keeps_one_scale_a_row_and_a_quarter_of_the_bytes():
    plain = linear()
    quantized = WeightOnlyLinear(plain, "int8")
    assert quantized.weight_low.dtype == torch.int8 and quantized.scales.shape == (160,)
    assert quantized.weight_low.nbytes * 4 == plain.weight.nbytes
    assert int(quantized.weight_low.abs().amax(dim=1).min()) == 127  # each row's largest weight uses the full range
    with pytest.raises(ValueError, match="unknown quantize mode"):
        WeightOnlyLinear(plain, "int2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_in_blocks_of_rows_equals_the_whole_weight_at_once(dtype, monkeypatch):
    """Quantized a few rows at a time (so a big head's float32 copy is never whole), the int8
    weight and its scales are those of the whole weight quantized in one go."""
    monkeypatch.setattr(quantize, "QUANTIZE_ROWS", 7)
    weight = torch.randn(30, 48, generator=torch.Generator().manual_seed(3)).to(dtype)
    whole = weight.float()
    scales = whole.abs().amax(dim=1).clamp(min=1e-12) / 127
    expected = torch.round(whole / scales[:, None]).clamp(-127, 127).to(torch.int8)
    quantized, got = quantize.int8_rows(weight)
    assert torch.equal(quantized, expected) and torch.equal(got, scales)


@pytest.mark.parametrize("mode", MODES)
def test_a_model_quantized_keeps_its_predictions(mode, tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        embedding = model.model.embed_tokens.weight.clone()
        assert quantize_linears(model, mode) == 7 * 2 + 1  # 7 projections in each of 2 layers, and the head
        got = model(ids).logits  # 40 rows: the prefill path
        step = model(ids[:, :1]).logits  # 1 row: the decode kernel
    assert all(type(m) is not nn.Linear for name, m in model.named_modules() if name.endswith(("_proj", "lm_head")))
    torch.testing.assert_close(model.model.embed_tokens.weight, embedding, rtol=0, atol=0)  # the lookup stays float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (step[0, 0] - want[0, 0]).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    assert quantize_linears(model, "none") == 0


def test_a_bfloat16_model_prefills_with_its_own_weights_and_decodes_from_int8(decode_kernel):
    """int8 over a bfloat16 layer keeps the bfloat16 weight for passes over many rows (exactly the
    plain layer's matmul there) and decodes from the int8 copy, within its rounding."""
    torch.manual_seed(0)
    plain = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    quantized = WeightOnlyLinear(plain, "int8")
    assert quantized.weight_full is not None and quantized.weight_full.data_ptr() == plain.weight.data_ptr()  # not a copy
    many, few = torch.randn(DECODE_ROWS + 1, 96).to(torch.bfloat16), torch.randn(3, 96).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(quantized(many), plain(many), rtol=0, atol=0)
        got, want = quantized(few), F.linear(few.float(), plain.weight.float(), plain.bias.float())
    assert got.dtype == torch.bfloat16
    bound = few.float().abs() @ weight_tolerance(plain.weight.float(), "int8").T + want.abs() * 2**-7 + 1e-2
    assert ((got.float() - want).abs() <= bound).all()
    quantized.weight_full = torch.zeros_like(plain.weight)  # which weight each pass reads
    with torch.no_grad():
        assert torch.equal(quantized(few), got)  # decode rows: the int8 copy
        torch.testing.assert_close(quantized(many), plain.bias.expand(len(many), -1), rtol=0, atol=0)  # prompts: the bf16 one


def test_only_int8_takes_a_bfloat16_model(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 weight-only quantization is for float32 models on CPU"):
        quantize_linears(model, "bf16")
    assert all(type(m) is nn.Linear for name, m in model.named_modules() if name.endswith(("_proj", "lm_head")))  # untouched
    assert quantize_linears(model, "int8") == 7 * 2 + 1
    half = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float16)
    with pytest.raises(ValueError, match="int8 weight-only quantization is for float32 or bfloat16 models"):
        quantize_linears(half, "int8")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"quantize": "int2"}, "unknown quantize"),
        ({"quantize": "bf16", "dtype": "bfloat16"}, "converts a float32 model"),
        ({"quantize": "int8", "dtype": "float16"}, "converts a float32 or bfloat16 model"),
        ({"quantize": "int4", "dtype": "float16"}, "quantize int4 converts a float32 or bfloat16 model"),
        ({"quantize": "bf16", "device": "cuda"}, "quantize is for CPU"),
    ],
)
def test_the_spec_refuses_what_it_cannot_run(flags, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec(**flags)
    assert ModelSpec(quantize="bf16").load_dtype == "float32" and ModelSpec().load_dtype == "auto"
    assert (
        ModelSpec(quantize="int8").load_dtype == "auto" and ModelSpec(quantize="int8", dtype="bfloat16").load_dtype == "bfloat16"
    )


def test_the_server_flag_is_validated(tiny_dir):
    with pytest.raises(ValidationError, match="unknown quantize"):
        tiny_settings(tiny_dir, quantize="fp8")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_int8_or_int4_over_a_bfloat16_model_is_served_and_says_so(mode, make_client):
    """`--dtype bfloat16 --quantize int8` (or int4): the card names both, the decoder feeds prompts
    in parts over the bf16 weights and steps over the low-bit copy, and a session answers."""
    if mode == "int4" and cpu_kernels.library() is None:
        pytest.skip("int4's rows are computed alone by longdoc's kernels only")
    client = make_client(quantize=mode, dtype="bfloat16")
    card = client.get("/v1/models").json()["data"][0]
    assert card["quantize"] == mode and card["dtype"] == "bfloat16"
    runtime = client.app.state.engine.models.named(card["id"])
    assert runtime.batcher is not None
    decoder = runtime.batcher._decoder
    assert decoder.whole_tail and decoder.rows_alone  # prompts in parts over bf16; steps over the int8 copy, a row alone
    layers = [m for name, m in runtime.loaded.model.named_modules() if name.endswith(("_proj", "lm_head"))]
    assert layers and all(type(m) is WeightOnlyLinear and m.weight_full is not None for m in layers)
    session = client.post("/v1/sessions", json={"memory": "text"}).json()["id"]
    assert client.post(f"/v1/sessions/{session}/documents", json={"text": "The key is 4417. " * 30}).status_code == 201
    answer = client.post(f"/v1/sessions/{session}/ask", json={"question": "What is the key?", "max_tokens": 8})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_server_answers_and_says_so(mode, make_client, adapter_dir):
    """Served quantized, with a Neurocache adapter: the card names the mode, the layers the adapter
    wraps stay float32, and every memory answers."""
    client = make_client(quantize=mode, adapter_dir=[str(adapter_dir)])
    card = client.get("/v1/models").json()["data"][0]
    assert card["quantize"] == mode and card["dtype"] == "float32"
    model = client.app.state.engine.models.named(card["id"]).loaded.model
    kinds = {type(m).__name__ for name, m in model.named_modules() if name.endswith(("_proj", "lm_head"))}
    assert "WeightOnlyLinear" in kinds and "LoRALinear" in kinds  # the adapter's layers were left alone
    for memory in ("text", "neurocache"):
        session = client.post("/v1/sessions", json={"memory": memory}).json()["id"]
        added = client.post(f"/v1/sessions/{session}/documents", json={"text": "The key is 4417. " * 30})
        assert added.status_code == 201 and len(client.get(f"/v1/sessions/{session}/documents").json()["data"]) == 1
        answer = client.post(f"/v1/sessions/{session}/ask", json={"question": "What is the key?", "max_tokens": 8})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0


def int4_tolerance(layer: WeightOnlyLinear) -> torch.Tensor:
    """How far an int4 weight may be from the float32 one: half its group's step, and the rounding
    of the group's scale and minimum to bfloat16 (8 bits of mantissa), over [out, in]."""
    pairs = layer.scales.float()  # [out, groups, 2]
    scale, low = pairs[..., 0], pairs[..., 1]
    per_group = scale / 2 * 1.001 + (15 * scale + low.abs()) * 2**-8
    return per_group.repeat_interleave(quantize.GROUP, dim=1)


@pytest.mark.parametrize("rows", [1, 3, DECODE_ROWS, DECODE_ROWS + 1, 200])
def test_an_int4_layer_stays_within_its_rounding_of_float32(rows, decode_kernel):
    """Each weight within half its group's step; decode rows are the stored weight times the
    float32 input (longdoc's kernel, or the widened weight where it cannot run; with int8 inputs, scale *
    code times the input rounded to int8), prefill rows exactly the float32 matmul on the widened
    weight."""
    torch.manual_seed(0)
    plain = nn.Linear(96, 160, bias=True)
    quantized = WeightOnlyLinear(plain, "int4")
    tolerance = int4_tolerance(quantized)
    assert ((quantized.dequantized() - plain.weight).abs() <= tolerance).all()
    x = torch.randn(rows, 96)
    with torch.no_grad():
        want, got = plain(x), quantized(x)
    coded, _ = int4_parts(quantized)
    rounding = (int4_inputs(x) - x.double()).abs() @ coded.abs().T  # int8 inputs multiply scale * code
    assert ((got - want).abs() <= x.abs() @ tolerance.T + rounding.float() + 1e-4).all()
    exact = (int4_product(quantized, x) + plain.bias.double()).float()
    if rows > DECODE_ROWS:
        widened = quantize.int4_weight(quantized.weight_low, quantized.scales)  # torch's widening, not the C one the layer uses
        torch.testing.assert_close(got, F.linear(x, widened, plain.bias), rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)


def test_int4_keeps_two_codes_a_byte_and_a_scale_and_minimum_a_group():
    weight = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    packed, groups = quantize.int4_groups(weight)
    assert packed.shape == (6, 32) and packed.dtype == torch.uint8
    assert groups.shape == (6, 2, 2) and groups.dtype == torch.bfloat16
    halves = packed.view(6, 2, 16)
    codes = torch.cat([halves & 15, halves >> 4], dim=-1)  # [rows, groups, 32]: byte j holds inputs j and j + 16
    in_order = weight.view(6, 2, 32).argsort(dim=-1)
    assert (codes.gather(-1, in_order[..., :1]) == 0).all()  # each group's smallest weight is its minimum
    assert (codes.gather(-1, in_order[..., -1:]) >= 14).all()  # and its largest at the top of the range
    assert (packed.nbytes + groups.nbytes) * 32 == weight.nbytes * 5  # 5 bits a weight
    torch.testing.assert_close(
        quantize.int4_weight(packed, groups),
        codes.float().view(6, 2, 32).mul(groups.float()[..., :1]).add(groups.float()[..., 1:]).view(6, 64),
        rtol=0,
        atol=0,
    )


def test_int4_in_blocks_of_rows_equals_the_whole_weight_at_once(monkeypatch):
    weight = torch.randn(30, 64, generator=torch.Generator().manual_seed(3))
    whole = quantize.int4_groups(weight)
    monkeypatch.setattr(quantize, "QUANTIZE_ROWS", 7)
    blocks = quantize.int4_groups(weight)
    assert all(torch.equal(a, b) for a, b in zip(whole, blocks, strict=True))


def test_int4_keeps_the_head_and_other_lengths_in_int8(tiny_dir):
    """The output head, and a projection whose inputs are not a multiple of 32, stay int8; a
    bfloat16 model keeps its own weights for prompts; the predictions stay close."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        assert quantize_linears(model, "int4") == 7 * 2 + 1
        got = model(ids).logits
        step = model(ids[:, :1]).logits
    modes = {name: m.mode for name, m in model.named_modules() if isinstance(m, WeightOnlyLinear)}
    assert modes.pop("lm_head") == "int8" and set(modes.values()) == {"int4"}
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    assert (step[0, 0] - want[0, 0]).abs().max() < 0.1 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8
    with pytest.raises(ValueError, match="multiple of 32"):
        WeightOnlyLinear(nn.Linear(72, 8), "int4")
    odd = nn.Sequential()
    odd.add_module("down_proj", nn.Linear(72, 8))
    odd.add_module("up_proj", nn.Linear(64, 8))
    assert quantize_linears(odd, "int4") == 2
    assert (odd.down_proj.mode, odd.up_proj.mode) == ("int8", "int4")
    half = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    assert quantize_linears(half, "int4") == 7 * 2 + 1
    down = half.model.layers[0].mlp.down_proj
    assert down.mode == "int4" and down.weight_full is not None  # prompts through the model's own bf16 weight


def test_a_served_model_gives_back_what_quantizing_freed(make_client, monkeypatch):
    """Quantizing's temporaries stay in the heap (engine/runtime/os_memory.py keeps freed memory): once a
    model is loaded the registry hands them back, after the warm-up."""
    calls: list[str] = []
    monkeypatch.setattr(registry, "return_free_memory", lambda: calls.append("trim"))
    warm = registry.warm_up

    def warm_up(runtime: registry.ModelRuntime) -> None:
        calls.append("warm")
        warm(runtime)

    monkeypatch.setattr(registry, "warm_up", warm_up)
    make_client(quantize="int8")
    assert calls == ["warm", "trim"]


def test_the_stored_mode_is_what_the_layers_got():
    """A model whose every projection fell back to int8 under int4 is reported as int8."""
    narrow = nn.Sequential()
    narrow.add_module("down_proj", nn.Linear(72, 8))
    narrow.add_module("lm_head", nn.Linear(64, 8))
    quantize_linears(narrow, "int4")
    assert quantize.stored_mode(narrow) == "int8"
    wide = nn.Sequential()
    wide.add_module("up_proj", nn.Linear(64, 8))
    wide.add_module("lm_head", nn.Linear(64, 8))
    quantize_linears(wide, "int4")
    assert quantize.stored_mode(wide) == "int4" and quantize.stored_mode(nn.Linear(4, 4)) == "none"


def _loaded(name: str, source: str, device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    return cast(LoadedModel, SimpleNamespace(name=name, source=source, device=torch.device(device), dtype=dtype))


def test_the_default_weights_are_the_manifests_measured_mode_on_cpu_only(tmp_path):
    """`--quantize auto` (the default): int4 for the default model on a CPU (its manifest, chosen on
    the QA benchmark), none on a GPU, for float16 weights, for a model nobody measured, and for a
    manifest naming a mode it may not; an explicit mode is kept."""
    assert ModelSpec().quantize == "auto"
    assert manifests.cpu_quantize(manifests.manifest_of(DEFAULT_MODEL, DEFAULT_MODEL)) == "int4"
    assert quantize_mode("auto", _loaded(DEFAULT_MODEL, DEFAULT_MODEL)) == "int4"
    assert quantize_mode("auto", _loaded(DEFAULT_MODEL, DEFAULT_MODEL, "cuda")) == "none"
    assert quantize_mode("auto", _loaded(DEFAULT_MODEL, DEFAULT_MODEL, dtype=torch.float16)) == "none"
    assert quantize_mode("none", _loaded(DEFAULT_MODEL, DEFAULT_MODEL)) == "none"
    assert quantize_mode("int8", _loaded(DEFAULT_MODEL, DEFAULT_MODEL)) == "int8"
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert quantize_mode("auto", _loaded("my-model", str(folder))) == "none"
    (folder / "longdoc.json").write_text(json.dumps({"cpu_quantize": "bf16"}))  # not over the model's own dtype
    assert quantize_mode("auto", _loaded("my-model", str(folder))) == "none"
    (folder / "longdoc.json").write_text(json.dumps({"cpu_quantize": "int8"}))
    assert quantize_mode("auto", _loaded("my-model", str(folder))) == "int8"
