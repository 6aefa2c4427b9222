# Two commands a newcomer needs: `make serve` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
DEMO_CKPT ?= build/demo-checkpoint
DEMO_ENGINE ?= engines/demo
PROFILE ?= cpu-dev

.PHONY: install test serve demo-engine clean

# torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# Build the compiled kernels (paged attention, fused layer ops) now rather than on the first request; a
	# machine without a C++ compiler gets the pure-torch path, said here.
	$(PY) -m trtprompt.engine.kernels
	# A real Prometheus for tests/test_monitoring_prometheus.py (skipped without it): Debian's
	# package where apt exists and we may use it; elsewhere say so and go on.
	command -v prometheus >/dev/null || ! command -v apt-get >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } || \
	  echo "make install: could not apt-get install prometheus (root needed); the Prometheus test will be skipped"
	touch $(STAMP)

install: $(STAMP)

$(DEMO_CKPT)/config.json: | $(STAMP)
	$(VENV)/bin/trtprompt demo-checkpoint $(DEMO_CKPT) --size small

$(DEMO_ENGINE)/config.json: $(DEMO_CKPT)/config.json
	$(VENV)/bin/trtprompt build $(DEMO_CKPT) -o $(DEMO_ENGINE) --profile $(PROFILE) --force

demo-engine: $(DEMO_ENGINE)/config.json

test: $(STAMP)
	$(PY) -m pytest -q

serve: demo-engine
	$(VENV)/bin/trtprompt serve $(DEMO_ENGINE)

clean:
	rm -rf build $(DEMO_ENGINE)
