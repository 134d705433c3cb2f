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

# torch first, pinned: an open range would pull GBs of CUDA builds. The editable install
# compiles the flight recorder's C parts in place (setup.py), so a change to them installs
# again. It builds without isolation, in this venv, because the tensor reader compiles
# against this torch's headers.
$(STAMP): $(BIN)/python pyproject.toml setup.py comm/observe/flight_ring.c comm/observe/tensor_reader.cpp \
		comm/observe/tensor_reader.h
	$(BIN)/pip install "$(TORCH)" "setuptools>=69" wheel
	$(BIN)/pip install --no-build-isolation -e ".[mpi,dev]"
	touch $(STAMP)

install: $(STAMP)

# The whole story in under two minutes on 2 cores: a byte-level GPT on this Python's own
# standard library source (every machine with Python has it). What runs where and what it
# costs, the text to a token file, 600 steps of data parallel training on 2 ranks with a
# cosine schedule and held-out evaluation (loss and eval loss fall), a few lines generated from
# the saved checkpoint, and the curves as a picture.
DEMO      := demo-out
DEMO_DIMS := --dim vocab=256 --dim seq=64 --dim hidden=64 --dim ffn=256 --dim batch=16
STDLIB     = $(shell $(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
demo: $(STAMP)
	$(BIN)/soapstone explain examples/gpt.par --parallel dp2 $(DEMO_DIMS)
	mkdir -p $(DEMO) && rm -rf $(DEMO)/ckpt
	$(BIN)/soapstone tokenize $(STDLIB)/*.py -o $(DEMO)/python.bin
	OMP_NUM_THREADS=1 $(BIN)/mpiexec -n 2 $(BIN)/soapstone run examples/gpt.par --parallel dp2 \
		$(DEMO_DIMS) --data $(DEMO)/python.bin --steps 600 --lr 3e-3 --lr-schedule cosine \
		--warmup 30 --eval-every 150 --eval-steps 4 --metrics $(DEMO)/metrics.jsonl \
		--save $(DEMO)/ckpt
	OMP_NUM_THREADS=2 $(BIN)/soapstone generate examples/gpt.par $(DEMO_DIMS) \
		--init $(DEMO)/ckpt --prompt "def " --tokens 150 --temperature 0.8 --top-k 40
	$(BIN)/soapstone plot $(DEMO)/metrics.jsonl -o $(DEMO)/loss.png

test: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q

# Rewrite the golden `show` files (tests/golden/*.txt) from what show prints now; tests only
# compare against them. Review the diff like code.
golden: $(STAMP)
	$(BIN)/python tests/update_golden.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info $(DEMO)
