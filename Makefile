# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
TORCH   ?= torch==2.13.0
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test golden lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

# torch first, pinned: an open range would pull GBs of CUDA builds.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e ".[mpi,dev]"
	touch $(STAMP)

install: $(STAMP)

# What runs where and what it costs, then 100 steps of data x tensor parallel GPT on 4 ranks.
demo: $(STAMP)
	$(BIN)/soapstone explain examples/gpt.par --parallel dp2tp2
	OMP_NUM_THREADS=1 $(BIN)/mpiexec -n 4 $(BIN)/soapstone run examples/gpt.par \
		--parallel dp2tp2 --steps 100 --metrics demo-metrics.jsonl

test: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q

# Rewrite the golden `show` files (tests/golden/*.txt) from what show prints now; tests only
# compare against them. Review the diff like code.
golden: $(STAMP)
	$(BIN)/python tests/update_golden.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
