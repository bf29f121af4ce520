#!/bin/sh
# CMake flags for building llama-cpp-python (make peers) for this CPU's vector extensions, with
# llama.cpp's AMX backend left out: built natively on a Xeon with AMX, it segfaulted on the default
# model's first completion (2026-11-24; its AMX matmul, cf. ggml-org/llama.cpp#20824).
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
has() { case " $flags " in *" $1 "*) return 0 ;; esac; return 1; }
out="-DGGML_NATIVE=OFF"
has avx2 && out="$out -DGGML_AVX2=ON"
has fma && out="$out -DGGML_FMA=ON"
has f16c && out="$out -DGGML_F16C=ON"
has avx_vnni && out="$out -DGGML_AVX_VNNI=ON"
has avx512f && out="$out -DGGML_AVX512=ON"
has avx512_vnni && out="$out -DGGML_AVX512_VNNI=ON"
has avx512_bf16 && out="$out -DGGML_AVX512_BF16=ON"
has avx512vbmi && out="$out -DGGML_AVX512_VBMI=ON"
echo "$out"
