# The two commands a newcomer needs are `make demo` and `make test`; the rest serve them.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install only when the package metadata changed.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test unit integration bench-cpu proto install e2e e2e-kind vllm-venv scan

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q -e '.[daemon,demo,operator,test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/weightcache demo

test: $(STAMP) cluster-build vllm-venv
	$(PY) -m pytest tests

# Real vLLM (its CPU build) for tests/vllm/ and bench/vllm_restart.py, in a venv of its
# own (vLLM pins an older torch), cached outside the checkout: ~6 min and 6 GB once,
# seconds after (tests/vllm/venv.sh).
vllm-venv:
	PYTHON=$(PYTHON) bash tests/vllm/venv.sh

# The static scan (scan/README.md): checkov on the rendered chart and on what the operator
# generates for representative caches; fails on any finding scan/skips.yaml does not
# justify. checkov has a venv of its own, cached outside the checkout (~1 min once).
scan: $(STAMP) cluster-build
	$(PY) scan/run.py $(SCAN_ARGS)

# Regenerate the wire contract's Python module from proto/ (tests check it is current).
proto: $(STAMP)
	$(PY) proto/generate.py

bench-cpu: $(STAMP)
	$(PY) bench/attach_cpu.py

# The end-to-end suite (e2e/README.md): against the test control plane (what CI runs),
# or on a kind cluster with freshly built images (needs Docker and kind).
e2e: $(STAMP) cluster-build
	PY=$(PY) bash e2e/local.sh $(E2E_ARGS)

e2e-kind: $(STAMP)
	PY=$(PY) bash e2e/kind.sh $(E2E_ARGS)

-include tests/cluster/cluster.mk
