# Two commands work on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# Test processes: most tests wait on sockets, processes and timers, so two workers halve the
# wall time on two cores; hivemind swarms stay on one worker (xdist_group "hivemind").
TEST_WORKERS ?= 2

.PHONY: demo test lint bench proto clean venv torch docs

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)

# torch is installed only when missing: a pinned CPU build, never a multi-GB default.
torch: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)

demo: torch
	$(PIP) install -q -e ".[agent,server]"
	$(VENV)/bin/flotilla demo

# The dashboard's browser test drives Debian's chromium through chromium-driver: installed
# here when missing and running as root; otherwise the test skips (and fails under CI=true).
.PHONY: browser
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				chromium chromium-driver >/dev/null) \
				|| echo "browser: could not install chromium; the browser test will skip"; \
		else \
			echo "browser: no chromium/chromedriver and not root; the browser test will skip"; \
		fi; \
	fi

test: torch browser
	$(PIP) install -q -e ".[dev]"
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

lint:
	$(VENV)/bin/ruff check flotilla tests benchmarks docs_hooks
	$(VENV)/bin/ruff format --check flotilla tests benchmarks docs_hooks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

bench:
	$(PY) benchmarks/federation.py --quick
	$(PY) benchmarks/aggregation.py --quick
	$(PY) benchmarks/compression.py --quick
	$(PY) benchmarks/simulation.py --quick
	$(PY) benchmarks/scheduling.py --quick

# The docs site into site/: --strict fails on any broken link or anchor, and nothing is
# fetched (no web fonts, no CDN). Installs the docs and server extras only when missing.
docs: $(PY)
	@$(PY) -c "import mkdocs, material, aiohttp" 2>/dev/null || $(PIP) install -q -e ".[server,docs]"
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) $(PY) -m mkdocs build --strict

proto:
	$(PY) -m flotilla.proto.generate

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .mypy_cache .ruff_cache
