"""longdoc's own decode kernels on CPU (csrc/: weight-only matmuls, and a whole decode step in
engine/models/native_step.py), built on first use.

torch's bf16 and int8 weight-only kernels read a decode step's weights at 5-11 GB/s on a 2-core
AVX2 machine, where a plain read of memory reaches 20-30 GB/s; the step is bound by that read.
The C kernel converts each weight to float32 in registers as it is read and shares the output
rows among torch's OpenMP team (built with gcc's `-fopenmp` it needs `libgomp.so.1`, which torch's
x86 wheels have already loaded: one runtime, one team): on the same machine it reads them at
14-20 GB/s (docs/log/2026-11-24-native-step.md). It takes float32 activations (torch's kernels
take bfloat16 ones) and sums every output in one order, whatever the number of rows beside it.

It is compiled with the system's C compiler into the cache directory the first time a process
needs it (about a second), keyed by a hash of the sources, the compiler's name (`CC`, else `cc`)
and its flags; a built copy is loaded without a compiler. `longdoc serve --cache-dir` does not
move it: the directory follows the environment (`kernel_dir`). Where it cannot be built or loaded
(no compiler, a CPU without AVX2 and FMA, `LONGDOC_CPU_KERNELS=0`), `library()` returns None and
the caller uses torch's kernels. On a CPU with AVX-512 the matmuls run their AVX-512 versions
(chosen at run time, so one build serves both; `LONGDOC_CPU_AVX512=0` keeps the AVX2 ones). int4
rounds its inputs to int8 and multiplies bytes, as llama.cpp's Q4 x Q8 does, with the AVX2 kernels
(vpmaddubsw) and with the AVX-512 ones where the CPU has VNNI, and int8 (the int4 model's head;
every projection under `--quantize int8`) with the AVX-512 ones where the CPU has VNNI
(`LONGDOC_CPU_INT8_INPUTS=0` keeps float32 inputs for both, as `LONGDOC_CPU_VNNI=0` did before;
the VNNI kernels need gcc 8 or a clang that knows `avx512vnni` to build).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from engine.config import operator_cache_dir

SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("weight_only.h", "weight_only.c", "decode_step.c"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
ALIGN = 32  # the kernel reads the input features 32 at a time
log = logging.getLogger(__name__)


def _compiler() -> str:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise OSError("no C compiler (cc) on PATH")
    return os.path.realpath(compiler)


def _build(target: Path) -> None:
    """Compile the source into `target` (written aside, then moved in: other processes may race)."""
    compiler = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        sources = [str(path) for path in SOURCES if path.suffix == ".c"]
        subprocess.run([compiler, *FLAGS, *sources, "-o", str(built), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(built, target)


def kernel_dir() -> Path:
    """Where built kernels are kept: `LONGDOC_KERNEL_DIR`, else kernels/ in the cache directory
    (`LONGDOC_CACHE_DIR`, as the server's settings read it, else its default)."""
    return Path(os.environ.get("LONGDOC_KERNEL_DIR") or operator_cache_dir() / "kernels").expanduser()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None where they cannot be used here (then torch's kernels are)."""
    if os.environ.get("LONGDOC_CPU_KERNELS", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        built_by = " ".join((os.environ.get("CC", "cc"), *FLAGS)).encode()  # named, not looked up: a
        # built copy loads where no compiler is (the image's final stage)
        digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES) + built_by).hexdigest()[:16]
        target = kernel_dir() / f"longdoc-cpu-{digest}.so"
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        log.warning("weight-only CPU kernels unavailable, using torch's: %s %s", error, detail.decode(errors="replace")[-500:])
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_long
    for kernel in (lib.int8_matmul, lib.bf16_matmul, lib.int4_matmul):
        kernel.argtypes = [pointer, size, size, pointer, pointer, size, pointer]
        kernel.restype = None
    lib.int4_dequantize.argtypes, lib.int4_dequantize.restype = [pointer, pointer, size, size, pointer], None
    for switch in (lib.matmul_avx512, lib.matmul_int8_inputs):
        switch.argtypes, switch.restype = [size], size
    for question in (lib.int4_rounds_inputs, lib.int8_rounds_inputs):
        question.argtypes, question.restype = [], size
    lib.matmul_avx512(0 if os.environ.get("LONGDOC_CPU_AVX512", "1") == "0" else 1)
    if "LONGDOC_CPU_VNNI" in os.environ:  # its name until 2026-11-28: still honoured where the new one is unset
        ignored = " (ignored: LONGDOC_CPU_INT8_INPUTS is set)" if "LONGDOC_CPU_INT8_INPUTS" in os.environ else ""
        log.warning("LONGDOC_CPU_VNNI is now LONGDOC_CPU_INT8_INPUTS (int4 on int8 inputs, AVX2 or AVX-512 VNNI)%s", ignored)
    wanted = os.environ.get("LONGDOC_CPU_INT8_INPUTS", os.environ.get("LONGDOC_CPU_VNNI", "1"))
    lib.matmul_int8_inputs(0 if wanted == "0" else 1)
    return lib


def use_avx512(wanted: bool | None = None) -> bool:
    """Whether the matmuls run their AVX-512 versions (csrc/weight_only.c; the default where the CPU
    has AVX-512 F/BW/VL, unless `LONGDOC_CPU_AVX512=0`): `wanted` True turns them on where the CPU
    has them, False off (the AVX2 ones), None only asks."""
    lib = library()
    if lib is None:
        return False
    return bool(lib.matmul_avx512(-1 if wanted is None else int(wanted)))


def use_int8_inputs(wanted: bool | None = None) -> bool:
    """Whether int4 rounds its inputs to int8 and multiplies bytes where it can (the default, unless
    `LONGDOC_CPU_INT8_INPUTS=0`), as `use_avx512`: with the AVX2 kernels, and with the AVX-512 ones
    on a CPU with VNNI (`int4_rounds_inputs` tells whether it does now); int8 (the int4 model's
    output head, and every projection under `--quantize int8`) likewise with the AVX-512 ones on a
    CPU with VNNI (`int8_rounds_inputs`). Off, both
    widen their weights to float32 and multiply the inputs as they are."""
    lib = library()
    if lib is None:
        return False
    return bool(lib.matmul_int8_inputs(-1 if wanted is None else int(wanted)))


def int4_rounds_inputs() -> bool:
    """Whether int4's matmuls round their inputs to int8 now (`use_int8_inputs`, and a kernel set
    that can: the AVX2 one, or the AVX-512 one on a CPU with VNNI)."""
    lib = library()
    return lib is not None and bool(lib.int4_rounds_inputs())


def int8_rounds_inputs() -> bool:
    """Whether int8's matmuls round their inputs to int8 now (`use_int8_inputs`, the AVX-512 kernel
    set, a CPU with VNNI)."""
    lib = library()
    return lib is not None and bool(lib.int8_rounds_inputs())


def usable(weight: torch.Tensor, features: int | None = None) -> bool:
    """Whether the kernels can multiply by this stored weight ([out, in], bf16 or int8, on CPU;
    int4: [out, in / 2] bytes, `features` its in)."""
    features = weight.shape[1] if features is None else features
    return weight.device.type == "cpu" and weight.is_contiguous() and features % ALIGN == 0 and library() is not None


def matmul(rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """rows [R, in] times weight [out, in] transposed (bf16, or int8 with float32 scales [out]):
    [R, out] float32. The caller checked `usable(weight)`."""
    lib = library()
    assert lib is not None
    x = rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    if weight.dtype == torch.int8:
        assert scales is not None and scales.dtype == torch.float32 and scales.is_contiguous()
        kernel, scale_pointer = lib.int8_matmul, scales.data_ptr()
    else:
        assert weight.dtype == torch.bfloat16
        kernel, scale_pointer = lib.bf16_matmul, None
    kernel(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), scale_pointer, weight.shape[0], out.data_ptr())
    return out


def int4_matmul(rows: torch.Tensor, packed: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """rows [R, in] times the int4 weight (`quantize.int4_groups`: packed [out, in / 2], groups
    [out, in / 32, 2] bfloat16) transposed: [R, out] float32. The caller checked `usable`."""
    lib = library()
    assert lib is not None and packed.dtype == torch.uint8 and groups.dtype == torch.bfloat16 and groups.is_contiguous()
    x = rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.to(torch.float32).contiguous()
    assert x.shape[1] == 2 * packed.shape[1]
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32)
    lib.int4_matmul(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), groups.data_ptr(), packed.shape[0], out.data_ptr())
    return out


_scratch = threading.local()  # each thread's float32 buffer for `int4_dequantize(..., reuse=True)`


def int4_dequantize(packed: torch.Tensor, groups: torch.Tensor, reuse: bool = False) -> torch.Tensor:
    """The float32 weight [out, in] of an int4 weight (`quantize.int4_groups`' packed and groups),
    as `quantize.int4_weight` computes it, bit for bit, the rows shared among the threads. With
    `reuse`, it is written into this thread's buffer (kept, grown to the largest weight asked for:
    55 MB for the default model's MLP), valid until the thread's next such call: a fresh tensor of
    that size costs its page faults every time, eight times the conversion itself. The caller
    checked `usable`."""
    lib = library()
    assert lib is not None and packed.dtype == torch.uint8 and groups.dtype == torch.bfloat16
    assert packed.is_contiguous() and groups.is_contiguous()
    rows, features = packed.shape[0], 2 * packed.shape[1]
    assert groups.shape == (rows, features // 32, 2), (groups.shape, packed.shape)  # the C reads this many
    if reuse:
        buffer = getattr(_scratch, "buffer", None)
        if buffer is None or buffer.numel() < rows * features:
            buffer = _scratch.buffer = torch.empty(rows * features, dtype=torch.float32)
        out = buffer[: rows * features].view(rows, features)
    else:
        out = torch.empty(rows, features, dtype=torch.float32)
    lib.int4_dequantize(packed.data_ptr(), groups.data_ptr(), rows, features, out.data_ptr())
    return out
