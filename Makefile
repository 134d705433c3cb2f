# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
TORCH   ?= torch==2.13.0
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test golden lint install clean gpu-wheels gpu-check

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

# The CUDA path on one GPU (README, "On a GPU"). `make gpu-wheels` runs where the package
# registries are (a CPU machine will do): soapstone's wheel and every dependency for Linux
# x86_64, CPython $(GPU_PYVER), CUDA $(GPU_CUDA) (cupy-cuda13x or -cuda12x, and NCCL), torch left
# out: the GPU image has its own. Copy the checkout with $(WHEELS)/ to the GPU machine and run
# `make gpu-check` there, offline: a venv over the image's Python and torch, soapstone from the
# wheels, then `soapstone gpu-check` (about 4 minutes on an H100; the report in $(GPU_REPORT)).
WHEELS     ?= gpu-wheels
GPU_PYVER  ?= 3.12
GPU_CUDA   ?= 13
GPU_BUILD  ?= python$(GPU_PYVER)
GPU_PY     ?= python3
GPU_VENV   ?= .venv-gpu
GPU_REPORT ?= gpu-check.json
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform linux_x86_64
gpu-wheels:
	mkdir -p $(WHEELS)
	$(GPU_BUILD) -m pip wheel --no-deps -w $(WHEELS) .
	$(GPU_BUILD) -m pip download -d $(WHEELS) --only-binary=:all: $(GPU_PLATFORMS) \
		--python-version $(GPU_PYVER) --implementation cp "numpy" "mpi4py>=4" attrs lark tqdm \
		safetensors isal mpich pytest hypothesis "setuptools>=69" wheel \
		cupy-cuda$(GPU_CUDA)x nvidia-nccl-cu$(GPU_CUDA)

gpu-check:
	@$(GPU_PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" || \
		{ echo "make gpu-check: no CUDA GPU here (torch in $(GPU_PY) sees none); run it on a GPU machine" >&2; exit 2; }
	@test -d $(WHEELS) || { echo "make gpu-check: no $(WHEELS)/ here; run \`make gpu-wheels\` where the package registries are and copy the folder beside this Makefile" >&2; exit 2; }
	# the image's Python is itself a venv (/opt/torch/.venv), whose packages a venv made from it
	# does not inherit: a .pth names them, after the new venv's own
	test -x $(GPU_VENV)/bin/python || { $(GPU_PY) -m venv --system-site-packages $(GPU_VENV) && \
		$(GPU_PY) -c "import site; print('\\n'.join(site.getsitepackages()))" > \
			"$$($(GPU_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/gpu_image.pth"; }
	extra=$$($(GPU_PY) -c "import torch; print('gpu13' if (torch.version.cuda or '').startswith('13') else 'gpu')"); \
	$(GPU_VENV)/bin/pip install --no-index --find-links $(WHEELS) --force-reinstall --no-deps soapstone mpi4py mpich && \
	$(GPU_VENV)/bin/pip install --no-index --find-links $(WHEELS) "soapstone[mpi,$$extra]" pytest hypothesis
	$(GPU_VENV)/bin/soapstone gpu-check --report $(GPU_REPORT)

clean:
	rm -rf $(VENV) build *.egg-info $(DEMO)
