"""longdoc's weight-only decode kernels (engine/models/cpu_kernels.py): built where a C compiler and
AVX2 are, equal to the float32 product of the stored weights, a row's bits independent of the rows
beside it, and torch's kernels wherever they cannot be used."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.models import cpu_kernels, quantize
from engine.models.quantize import DECODE_ROWS, WeightOnlyLinear
from tests.helpers import TEST_DEVICE, int4_inputs, int4_parts, int4_product, int8_inputs

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU kernels")
BUILDABLE = shutil.which("cc") is not None and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
MODES = ("bf16", "int8", "int4")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """library() built again, into a scratch directory, and forgotten afterwards."""
    monkeypatch.setenv("LONGDOC_KERNEL_DIR", str(tmp_path))
    cpu_kernels.library.cache_clear()
    yield tmp_path
    cpu_kernels.library.cache_clear()


def stored(mode: str, out_features: int = 37, in_features: int = 96, seed: int = 0) -> WeightOnlyLinear:
    torch.manual_seed(seed)
    return WeightOnlyLinear(nn.Linear(in_features, out_features, bias=False), mode)


def product(layer: WeightOnlyLinear, x: torch.Tensor) -> torch.Tensor:
    if layer.mode == "int4":
        return cpu_kernels.int4_matmul(x, layer.weight_low, layer.scales)
    return cpu_kernels.matmul(x, layer.weight_low, layer.scales if layer.mode == "int8" else None)


def exact(layer: WeightOnlyLinear, x: torch.Tensor) -> torch.Tensor:
    """The product the kernel computes, in float64 (int4 and int8: of the inputs it multiplies), as float32."""
    if layer.mode == "int4":
        return int4_product(layer, x).float()
    inputs = int8_inputs(x) if layer.mode == "int8" else x.double()
    return (inputs @ layer.dequantized().double().T).float()


@pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU")
def test_the_kernels_build_into_the_kernel_dir(fresh):
    assert cpu_kernels.library() is not None
    assert [p.suffix for p in fresh.iterdir()] == [".so"]


@pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU")
def test_the_avx512_kernels_can_be_turned_off(fresh, monkeypatch):
    monkeypatch.setenv("LONGDOC_CPU_AVX512", "0")
    assert cpu_kernels.library() is not None and not cpu_kernels.use_avx512()
    flags = open("/proc/cpuinfo").read().split()
    assert cpu_kernels.use_avx512(True) == all(f in flags for f in ("avx512f", "avx512bw", "avx512vl"))


@pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU")
def test_a_built_copy_loads_where_no_compiler_is(fresh, monkeypatch):
    """The image builds the kernels in its build stage; its final stage has no compiler."""
    assert cpu_kernels.library() is not None
    cpu_kernels.library.cache_clear()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert cpu_kernels.library() is not None
    assert len(list(fresh.iterdir())) == 1


@pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, DECODE_ROWS])
def test_equal_to_the_float32_product_of_the_stored_weights(mode, rows, kernel_set):
    layer = stored(mode)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    want = exact(layer, x)
    got = product(layer, x)
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU")
@pytest.mark.parametrize("mode", MODES)
def test_a_row_gets_the_same_bits_in_any_company(mode, kernel_set):
    layer = stored(mode, out_features=65, in_features=160)  # an odd count: the last output pairs with itself
    x = torch.randn(DECODE_ROWS, 160, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([product(layer, x[i : i + 1]) for i in range(DECODE_ROWS)])
    for count in range(2, DECODE_ROWS + 1):
        assert torch.equal(product(layer, x[:count]), alone[:count]), count
    assert torch.equal(product(layer, x.flip(0)), alone.flip(0))


@pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU")
# AVX2 on int8 inputs: a last quad of 0-3 groups; VNNI: a last span of 8-11, 13, 15, 16 or 1 groups (13 and 15
# end inside its 4th vector of codes)
@pytest.mark.parametrize("in_features", [256, 288, 320, 352, 416, 480, 512, 544, 1536])
def test_int4_over_whole_blocks_of_groups_and_their_tails(in_features, kernel_set):
    """int4 reads the groups' scales and minimums 16 (AVX-512, AVX2 on int8 inputs) or 8 (AVX2 on
    float inputs) groups at a time: whole
    blocks, blocks and a tail, several blocks; the product, and a row's bits in any company."""
    layer = stored("int4", out_features=33, in_features=in_features, seed=in_features)
    # 15 rows: in blocks of 4, 4 and 4, then 2 and 1
    x = torch.randn(15, in_features, generator=torch.Generator().manual_seed(5))
    want = exact(layer, x)
    got = product(layer, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = torch.cat([product(layer, x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(got, alone)


@pytest.mark.parametrize("kernel_set", ["avx2", "avx512"], indirect=True)  # on the same inputs (int8 inputs: the next test)
@pytest.mark.parametrize("mode", ["bf16", "int4"])
def test_the_avx512_kernels_run_where_asked(mode, kernel_set):
    """Both sets give the product; they sum in different orders, so their bits differ somewhere:
    proof that turning AVX-512 on or off changes which kernels run."""
    layer = stored(mode, out_features=256, in_features=1536)
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(3))
    mine = product(layer, x)
    cpu_kernels.use_avx512(kernel_set == "avx2")
    if cpu_kernels.use_avx512() != (kernel_set == "avx2"):
        pytest.skip("no AVX-512 on this CPU")
    other = product(layer, x)
    torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-4)
    assert not torch.equal(mine, other)


def off_gives_the_float_product(layer: WeightOnlyLinear, x: torch.Tensor, got: torch.Tensor, plain: torch.Tensor) -> None:
    """With int8 inputs turned off, the layer's product is the float32 inputs' (`plain`), not `got`."""
    cpu_kernels.use_int8_inputs(False)
    widened = product(layer, x)
    assert not torch.equal(got, widened)
    torch.testing.assert_close(widened, plain.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel_set", ["avx2_int8", "vnni"], indirect=True)
def test_int4_on_int8_inputs_rounds_them(kernel_set):
    """On int8 inputs (the default with the AVX2 kernels, and with the AVX-512 ones where the CPU has
    VNNI) int4 gives the product of the rounded inputs (shown above); each is within half its
    group's step of the input and multiplies scale * code only, so the product stays within
    |x - rounded| @ |scale * code| of the float32 inputs' one, and is not it; with int8 inputs
    off, it is that product."""
    layer = stored("int4", out_features=64, in_features=544)  # 17 groups: a last quad (AVX2) or span (VNNI) of 1
    x = torch.randn(3, 544, generator=torch.Generator().manual_seed(7)) * torch.linspace(0.1, 10, 544)
    rounded = int4_inputs(x)
    step = x.reshape(3, 17, 32).abs().amax(-1) / 127
    assert ((rounded - x.double()).abs().reshape(3, 17, 32) <= step[..., None] / 2 * 1.0001).all()
    got = product(layer, x)
    coded, _ = int4_parts(layer)
    plain = x.double() @ layer.dequantized().double().T
    assert ((got.double() - plain).abs() <= (rounded - x.double()).abs() @ coded.abs().T + 1e-4).all()
    off_gives_the_float_product(layer, x, got, plain)


@pytest.mark.parametrize("kernel_set", ["vnni"], indirect=True)
@pytest.mark.parametrize("in_features", [96, 544, 1536])  # under a span of 512; a span and a half vector; three spans
def test_int8_on_int8_inputs_rounds_them(in_features, kernel_set):
    """With the AVX-512 kernels on a CPU with VNNI, int8 (the int4 model's output head) multiplies
    its weights by the inputs rounded to int8, each lane's group of a span at its own step (shown
    above): each input within half its group's step, the product within |x - rounded| @ |weight| of
    the float32 inputs' one and not it; with int8 inputs off, it is that product."""
    layer = stored("int8", out_features=64, in_features=in_features)
    x = torch.randn(7, in_features, generator=torch.Generator().manual_seed(7)) * torch.linspace(0.1, 10, in_features)
    rounded = int8_inputs(x)
    spans = -(-in_features // 512)
    lanes = torch.zeros(7, spans * 512)
    lanes[:, :in_features] = x
    step = lanes.view(7, spans, 8, 16, 4).abs().amax(dim=(2, 4)) / 127  # [rows, span, lane]
    per_input = step[:, :, None, :, None].expand(7, spans, 8, 16, 4).reshape(7, -1)[:, :in_features]
    assert ((rounded - x.double()).abs() <= per_input / 2 * 1.0001).all()
    got = product(layer, x)  # rows in blocks of 4, 2 and 1
    torch.testing.assert_close(got, exact(layer, x), rtol=1e-5, atol=1e-5)  # the rounded inputs times the weights
    weight = layer.dequantized().double()
    plain = x.double() @ weight.T
    assert ((got.double() - plain).abs() <= (rounded - x.double()).abs() @ weight.abs().T + 1e-4).all()
    off_gives_the_float_product(layer, x, got, plain)


@pytest.mark.parametrize("kernel_set", ["vnni"], indirect=True)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int8_on_int8_inputs_carries_a_non_finite_input(bad, kernel_set):
    """A NaN or an infinite input makes its row's outputs NaN, as the float kernels' would be, not
    a finite product of the group rounded to zeros; the other rows keep their numbers."""
    layer = stored("int8", out_features=16, in_features=544)
    x = torch.randn(3, 544, generator=torch.Generator().manual_seed(2))
    clean = product(layer, x)
    x[1, 530] = bad  # in the second span's half vector
    got = product(layer, x)
    assert got[1].isnan().all()
    assert torch.equal(got[[0, 2]], clean[[0, 2]])


@pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU")
@pytest.mark.parametrize("variable", ["LONGDOC_CPU_INT8_INPUTS", "LONGDOC_CPU_VNNI"])  # its name before, still honoured
def test_int8_inputs_can_be_turned_off(fresh, monkeypatch, variable):
    monkeypatch.setenv(variable, "0")
    assert cpu_kernels.library() is not None and not cpu_kernels.use_int8_inputs()
    assert not cpu_kernels.int4_rounds_inputs()
    flags = Path("/proc/cpuinfo").read_text().split()
    assert cpu_kernels.use_int8_inputs(True)
    assert cpu_kernels.int4_rounds_inputs() == (not cpu_kernels.use_avx512() or "avx512_vnni" in flags)
    assert cpu_kernels.int8_rounds_inputs() == (cpu_kernels.use_avx512() and "avx512_vnni" in flags)


@pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU")
def test_int4_dequantize_gives_int4_weight_bit_for_bit_into_a_reused_buffer():
    """A prompt's pass widens int4 weights with the C conversion: the bits of `int4_weight`, fresh
    or in the thread's buffer, which grows for a larger weight and is reused for a smaller one."""
    small, large = stored("int4", 33, 352), stored("int4", 70, 544, seed=1)
    for layer in (small, large, small):
        want = quantize.int4_weight(layer.weight_low, layer.scales)
        assert torch.equal(cpu_kernels.int4_dequantize(layer.weight_low, layer.scales), want)
        reused = cpu_kernels.int4_dequantize(layer.weight_low, layer.scales, reuse=True)
        assert reused.shape == want.shape and torch.equal(reused, want)
    again = cpu_kernels.int4_dequantize(large.weight_low, large.scales, reuse=True)
    assert again.data_ptr() == reused.data_ptr()  # the same buffer: no allocation a pass


@pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU")
def test_a_layer_uses_them_for_decode_rows_only(monkeypatch):
    layer = stored("int8")
    calls: list[int] = []
    real = cpu_kernels.matmul

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(cpu_kernels, "matmul", counted)
    with torch.no_grad():
        layer(torch.randn(1, 3, 96))
        layer(torch.randn(DECODE_ROWS + 1, 96))  # a prefill: float32 on the widened weight
    assert calls == [3]


@pytest.mark.skipif(not BUILDABLE, reason="needs cc and an AVX2 CPU")
def test_with_gradients_a_layer_uses_torch_so_they_flow(monkeypatch):
    layer = stored("bf16")
    monkeypatch.setattr(cpu_kernels, "matmul", lambda *a: pytest.fail("the C kernel keeps no gradient"))
    x = torch.randn(2, 96, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_features_not_a_multiple_of_32_use_torch(monkeypatch):
    layer = stored("bf16", in_features=72)
    assert not cpu_kernels.usable(layer.weight_low)
    monkeypatch.setattr(cpu_kernels, "matmul", lambda *a: pytest.fail("the kernel reads 32 features at a time"))
    with torch.no_grad():
        got = layer(torch.randn(2, 72))
    assert got.shape == (2, 37)


def test_turned_off_or_unbuildable_falls_back_to_torch(fresh, monkeypatch, caplog):
    monkeypatch.setenv("LONGDOC_CPU_KERNELS", "0")
    assert cpu_kernels.library() is None
    monkeypatch.delenv("LONGDOC_CPU_KERNELS")
    cpu_kernels.library.cache_clear()
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="engine.models.cpu_kernels"):
        assert cpu_kernels.library() is None
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "unavailable" in caplog.text
    layer = stored("int8")
    x = torch.randn(2, 96)
    with torch.no_grad():
        got = layer(x)  # torch's int8 kernel on bfloat16 inputs
    torch.testing.assert_close(got, x @ layer.dequantized().T, rtol=2**-6, atol=2e-2)
