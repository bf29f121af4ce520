#!/usr/bin/env bash
# On the GPU machine (device tool), after scripts/gpu/stage.sh's parts are in /tmp/stage:
#   bash scripts/gpu/check.sh tests   # CUDA-vs-CPU tests, then the whole suite with CUDA as default device
#   bash scripts/gpu/check.sh bench   # serving speed per memory on a 100K+ token book; more arguments go to
#                                     # bench.bench_memories (--model qwen2.5-coder-1.5b-instruct --memories truncate text kvcache,
#                                     # with STAGE_MODEL's wheels staged)
#   bash scripts/gpu/check.sh kvcache # the kvcache memory's tests on CUDA (CUDA as default device)
#   bash scripts/gpu/check.sh longdoc eval needles --model smollm2-135m-instruct ...   # any longdoc command (the evals need data/qa carried; the small model is staged, the default with STAGE_MODEL)
# Logs and the benchmark table go to $OUT (what the device tool brings back).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d /tmp/site ]; then
  mkdir -p /tmp/payload && cat /tmp/stage/part-* | tar x -C /tmp/payload || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/payload/whl/*.whl || exit 1
fi
mkdir -p data && cp -rn /tmp/payload/corpus data/  # research.training.corpus.fetch() finds it and downloads nothing
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 LONGDOC_CACHE_DIR=/tmp/longdoc-cache
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
# 16 cores there: the CUDA-vs-CPU tests spread over workers, one test file per worker. The whole suite stays in
# one process: under xdist its workers collected different test_api_errors.py lists (2026-11-26, H200; not reproduced
# with 2 workers on a 2-core CPU machine). SUITE_FILES narrows it to some files, SUITE_TIMEOUT bounds it (s), JOBS sets the workers
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${JOBS:-8} --dist loadfile")
case "${1:-tests}" in
  tests)
    python3 -m pytest -q -rs -p no:cacheprovider $XDIST tests/engine/test_cuda.py tests/engine/test_state_cache.py 2>&1 | tee "$OUT/pytest-cuda-vs-cpu.log"
    LONGDOC_TEST_DEVICE=cuda timeout ${SUITE_TIMEOUT:-420} python3 -m pytest -q -rf -p no:cacheprovider --timeout 240 --durations 15 \
      --deselect tests/engine/test_cuda.py --ignore tests/e2e/test_ui_browser.py ${SUITE_FILES:-} 2>&1 | tee "$OUT/pytest-cuda-default.log" | tail -60
    cp test-artifacts/e2e-server.log "$OUT/" 2>/dev/null
    ;;
  kvcache)
    LONGDOC_TEST_DEVICE=cuda python3 -m pytest -q -rf -p no:cacheprovider tests/engine/test_kv_select.py tests/server/test_api_kvcache.py \
      2>&1 | tee "$OUT/pytest-kvcache-cuda.log" | tail -30
    ;;
  longdoc)
    shift
    # not pip-installed there: no entry points, so research's commands are mounted by hand
    python3 -c "import sys; sys.argv[0] = 'longdoc'; from clients.cli import app; from research.cli import mount; mount(app); app()" "$@"
    ;;
  bench)
    shift
    cp docs/benchmarks.md "$OUT/benchmarks.md"
    [ $# -gt 0 ] || set -- --memories truncate text neurocache kvcache
    LONGDOC_SESSION_MEMORY_BYTES=${LONGDOC_SESSION_MEMORY_BYTES:-8589934592} python3 -m bench.bench_memories --document data/corpus/plrabn12.txt \
      --repeats 4 --streams 8 --out "$OUT/benchmarks.md" "$@" 2>&1 | tee "$OUT/bench.log"
    ;;
esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
