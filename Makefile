# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU torch first, pinned: anything else pulls a multi-GB CUDA build (and nixl would drag it in).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

.PHONY: install demo test bench
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pdserve up --port 0 --ask "The prefill server sends the cache to" --exit

test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(PY) bench/engine.py
