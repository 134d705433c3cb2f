# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
TORCH   ?= torch==2.13.0
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

# torch first, pinned: an open range would pull GBs of CUDA builds.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e ".[mpi,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/mpiexec -n 2 $(BIN)/soapstone bench comm --sizes 8,64KiB,1MiB,4MiB --ops allreduce,allgather

test: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
