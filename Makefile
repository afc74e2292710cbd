# The two commands a newcomer needs (README, first section):
#   make run     set up, then the main job: the reproduction workflow on this machine's profile
#                (`cpu`, the tiny grid, without an NVIDIA GPU; the GPU's own profile with one),
#                measured into runs/<hardware>/<run>/ and compared with the committed results
#   make test    set up, then the whole test suite: ruff, pytest, the workflow's lint, the CPU workflow
#                (what CI runs: .ci/run)
# Setup is a file target (a stamp in the environment): a second call reuses what the first
# installed, until pyproject.toml, constraints-cpu.txt or this file changes.
# Settings: PYTHON (the interpreter that makes .venv), VENV (the environment), PROFILE, ARGS
# (more snakemake arguments and targets, e.g. ARGS=-n for a dry run, ARGS="scale depth"), CONFIG
# (workflow config items, e.g. CONFIG=host_memory_gb=500 on a host whose MemTotal grows as it is used).

SHELL := /bin/bash
PYTHON ?= python3
# The current virtual environment if there is one, used as it is: the activated one, else the one
# PYTHON belongs to (a GPU machine's image often puts its CUDA torch in a venv first on PATH,
# unactivated). Else .venv here. Recipes run with its bin/ first on PATH, as if activated, so the
# workflow's `python` and `megatrain` are the environment's.
PYTHON_VENV = $(shell $(PYTHON) -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")' 2>/dev/null)
VENV ?= $(or $(VIRTUAL_ENV),$(PYTHON_VENV),.venv)
VENV_ABS := $(abspath $(VENV))
export VIRTUAL_ENV := $(VENV_ABS)
export PATH := $(VENV_ABS)/bin:$(PATH)
PY := $(VENV_ABS)/bin/python
STAMP := $(VENV_ABS)/.megatrain-setup
PROFILE ?=
ARGS ?=
CONFIG ?=
PROFILES := $(sort $(notdir $(patsubst %/config.yaml,%,$(wildcard profiles/*/config.yaml))))

# An NVIDIA GPU is there when nvidia-smi lists one (no torch needed to ask).
HAS_GPU := nvidia-smi -L 2>/dev/null | grep -q '^GPU '
# $(call check_python,INTERPRETER,HINT): stop with HINT unless INTERPRETER is Python >= 3.11.
check_python = command -v $(1) >/dev/null 2>&1 || { echo "make: $(1) not found. MegaTrain needs Python >= 3.11: $(2)" >&2; exit 1; }; \
	$(1) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "make: $(1) is $$($(1) -V 2>&1); MegaTrain needs Python >= 3.11: $(2)" >&2; exit 1; }
NEWER_PYTHON = install it, or name one with PYTHON=, e.g. make $(or $(MAKECMDGOALS),setup) PYTHON=python3.12 (or an environment with VENV=path)

.DEFAULT_GOAL := help
.PHONY: help setup run test profile

help:
	@echo "make run      set up (the current virtual environment, else .venv), then the reproduction workflow on"
	@echo "              this machine's profile: cpu without a GPU, else the GPU's (PROFILE=name to choose)"
	@echo "make test     set up, then the whole test suite (ruff, pytest, snakemake --lint, the CPU workflow)"
	@echo "make setup    only set up: the CPU build of torch without a GPU, the installed torch kept with one"
	@echo "make profile  print the profile make run would use; profiles: $(PROFILES)"

setup: $(STAMP)

# On a GPU machine whose Python has a torch, the new environment sees that Python's packages: the
# CUDA build, which pip cannot choose (it depends on the driver), is kept. Without a GPU it is
# isolated, so what it runs is what it installed, whatever the interpreter holds.
$(PY):
	@$(call check_python,$(PYTHON),$(NEWER_PYTHON))
	@site=; if $(HAS_GPU) && $(PYTHON) -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)'; then \
	    site=--system-site-packages; echo "make: $(PYTHON) has a torch: $(VENV) sees it ($$site)"; fi; \
	echo "make: creating $(VENV) with $(PYTHON) ($$($(PYTHON) -V 2>&1))"; \
	$(PYTHON) -m venv $$site $(VENV_ABS) || { echo "make: $(PYTHON) -m venv failed. On Debian/Ubuntu: apt-get install python3-venv (or python3.X-venv), then rm -rf $(VENV) and run again" >&2; rm -rf $(VENV_ABS); exit 1; }

# Without a GPU: the CPU build of torch and the pinned versions of constraints-cpu.txt (an
# unpinned torch pulls gigabytes of CUDA wheels). With one: torch>=2.5 is already there and left
# alone, the rest at the newest versions (the README's manual setup, step for step).
$(STAMP): pyproject.toml constraints-cpu.txt Makefile | $(PY)
	@$(call check_python,$(PY),$(NEWER_PYTHON))
	@log=$$(mktemp); trap 'rm -f "$$log"' EXIT; \
	fail() { \
	    if grep -qE 'NewConnectionError|ConnectTimeout|name resolution|Network is unreachable|ProxyError' "$$log"; then \
	        echo "make: no network: pip could not reach the package index, and a first setup downloads MegaTrain's packages from it. Connect (behind a proxy: HTTPS_PROXY=...) and run make again; what was installed is kept."; \
	    else echo "make: pip could not install MegaTrain's packages into $(VENV) (its message is above): fix that and run make again."; fi >&2; \
	    exit 1; }; \
	pip_install() { $(PY) -m pip install -q "$$@" 2>&1 | tee -a "$$log"; [ "$${PIPESTATUS[0]}" = 0 ] || fail; }; \
	if $(HAS_GPU); then \
	    echo "make: NVIDIA GPU found: keeping the installed torch, installing .[dev,workflow] into $(VENV)"; \
	    pip_install -e ".[dev,workflow]"; \
	else \
	    echo "make: no NVIDIA GPU: installing the CPU build of torch and .[dev,workflow] into $(VENV) (first time: a few minutes)"; \
	    pip_install -c constraints-cpu.txt torch==2.13.0; \
	    pip_install -c constraints-cpu.txt -e ".[dev,workflow]"; \
	fi
	@touch $@
	@echo "make: $(VENV) is set up (a second make reuses it)"

# The profile: PROFILE= if given; cpu without an NVIDIA GPU; else named after the first GPU, an H200
# on a host under 1 TiB taking h200x4's grid (sized to 512 GiB; h200's is the paper's 1.5 TB host),
# or h200x8's with 8 GPUs or more (sized to 560 GiB).
detect_profile = \
	p="$(PROFILE)"; \
	if [ -z "$$p" ]; then \
	    gpu=$$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1); \
	    host_kib=$$(awk '/^MemTotal:/ {print $$2}' /proc/meminfo 2>/dev/null); \
	    case "$$gpu" in \
	        "") p=cpu ;; \
	        *GH200*) p=gh200 ;; \
	        *H200*) gpus=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); \
	                if [ "$${host_kib:-0}" -ge 1073741824 ]; then p=h200; elif [ "$$gpus" -ge 8 ]; then p=h200x8; \
	                else p=h200x4; fi ;; \
	        *H100*) p=h100 ;; \
	        *A100*) p=a100 ;; \
	        *A6000*) p=a6000 ;; \
	        *3090*) p=rtx3090 ;; \
	        *) echo "make: no profile is named for the GPU '$$gpu': choose one, make $(or $(MAKECMDGOALS),run) PROFILE=name, from: $(PROFILES)" >&2; exit 1 ;; \
	    esac; \
	fi; \
	if [ ! -f "profiles/$$p/config.yaml" ]; then \
	    echo "make: no profile '$$p' (profiles/$$p/config.yaml): choose one of: $(PROFILES)" >&2; exit 1; \
	fi

profile:
	@$(detect_profile); echo "$$p"

# Tools run as `python -m` from the environment, even where a system-site package provides them.
# The run measures this machine into a folder of its own (runs/<hardware>/<time>-<commit>-<machine>),
# then compares it with the committed results of its hardware (or its last run) and prints that
# table last; `python -m workflows.scripts.runs promote <folder>` makes it the committed results.
run: $(STAMP)
	@$(detect_profile); \
	dir=$$($(PY) -m workflows.scripts.runs name "profiles/$$p") || exit 2; \
	echo "make: python -m snakemake --profile profiles/$$p $(ARGS) --config run=$$dir $(CONFIG)"; \
	$(PY) -m snakemake --profile "profiles/$$p" $(ARGS) --config run=$$dir $(CONFIG); status=$$?; \
	$(PY) -m workflows.scripts.runs compare "$$dir" || status=$$((status ? status : $$?)); \
	exit $$status

# The CPU workflow is forced (--forceall): its outputs from an earlier run would otherwise pass
# untested (the profiles rerun on mtime only). The tests run on two workers (pytest-xdist), then
# those marked `alone` one at a time.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q --timeout 900 -n 2 -m "not alone"
	$(PY) -m pytest -q --timeout 900 -m alone
	$(PY) -m snakemake --lint
	$(PY) -m snakemake --profile profiles/cpu --forceall
