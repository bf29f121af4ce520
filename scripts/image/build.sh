#!/usr/bin/env bash
# `make image`: build the Dockerfile with buildah (no Docker engine needed), into podman's store.
#   IMAGE=longdoc:latest  VARIANT=cpu|cuda  TORCH_INDEX=<pip index with torch 2.13.0>  DOCKERFILE=Dockerfile
# Where public registries are out of reach, two stand-ins, each said aloud:
#  - the base image: built by scripts/image/base.sh (debootstrap) when it can be neither found nor pulled;
#  - torch: when TORCH_INDEX cannot be reached and pip's find-links folder holds the CPU wheel,
#    a one-package index on loopback serves that wheel for the build.
set -euo pipefail
cd "$(dirname "$0")/../.."
image=${IMAGE:-longdoc:latest}
variant=${VARIANT:-cpu}
base=docker.io/library/python:3.11-slim
torch_index=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

if ! podman image exists "$base" && ! timeout 60 podman pull -q "$base" >/dev/null 2>&1; then
  echo "cannot pull $base: building a stand-in"
  bash scripts/image/base.sh
fi

if ! curl -fsS -m 15 ${PIP_CERT:+--cacert "$PIP_CERT"} -o /dev/null "$torch_index/torch/"; then
  wheel=$(find "${PIP_FIND_LINKS:-/opt/wheels}" -maxdepth 1 -name 'torch-2.13.0+cpu-cp311-*.whl' 2>/dev/null | head -1 || true)
  if [ "$variant" != cpu ] || [ -z "$wheel" ]; then
    echo "cannot reach $torch_index and have no local torch wheel for VARIANT=$variant" >&2
    exit 1
  fi
  index=$(mktemp -d)
  mkdir "$index/torch"
  ln -s "$wheel" "$index/torch/"
  name=$(basename "$wheel")
  href=$(printf '%s' "$name" | sed 's/+/%2B/')
  printf '<a href="%s">%s</a>\n' "$href" "$name" > "$index/torch/index.html"
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 -m http.server --bind 127.0.0.1 --directory "$index" "$port" >/dev/null 2>&1 &
  server=$!
  trap 'kill "$server" 2>/dev/null || true; rm -rf "$index"' EXIT
  torch_index=http://127.0.0.1:$port
  echo "cannot reach ${TORCH_INDEX:-the PyTorch CPU index}: torch comes from $wheel"
fi

# a TLS-inspecting proxy's CA (this machine's bundle), for pip inside the build only
secret=()
[ -n "${PIP_CERT:-}" ] && secret=(--secret "id=pip-ca,src=$PIP_CERT")

start=$(date +%s)
buildah bud --isolation chroot --network host --format docker --layers \
  --build-arg VARIANT="$variant" --build-arg TORCH_INDEX="$torch_index" "${secret[@]}" \
  -f "${DOCKERFILE:-Dockerfile}" -t "$image" .
echo "built $image in $(( $(date +%s) - start )) s: $(podman image inspect --format '{{.Size}}' "$image") bytes"
