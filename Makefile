# Thin targets: each runs one visible command.
PYTHON ?= python
OUT ?= ../nanospec-handout
PRECISION ?= auto  # `make train PRECISION=fp32`: the reference every README figure names
PRESET ?= tiny  # `make train PRESET=gpu`: the deep GPU preset (one H100, ~5 min), into out-gpu/

.PHONY: install deps train test bench bench-batch bench-quick gpu-check figures handout grade

install:
	$(PYTHON) -m pip install -r requirements.txt

# `make train`, `make test` and `make grade` install requirements.txt first, only if a package is missing
# (a torch you installed yourself, say a CUDA build, is kept).
deps:
	@$(PYTHON) -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in \
	('torch', 'numpy', 'tiktoken', 'pytest', 'hypothesis')))" || $(PYTHON) -m pip install -r requirements.txt

train: deps
	$(PYTHON) train_tiny.py --preset $(strip $(PRESET)) --precision $(strip $(PRECISION))

test: deps
	$(PYTHON) -m pytest

bench:  # CKPT=out-gpu: the gpu preset's checkpoints
	$(PYTHON) -m nanospec.bench $(if $(CKPT),--ckpt $(CKPT))

bench-batch:  # batched ar, speculative and prompt-lookup at B = 1..32 (nanospec/bench_batch.py)
	$(PYTHON) -m nanospec.bench --batch-sizes 1,2,4,8,16,32 $(if $(CKPT),--ckpt $(CKPT))

bench-quick:
	$(PYTHON) -m nanospec.bench --quick

# The PNGs of README.md and docs/ from out/ and bench_results.json (needs matplotlib: pip install matplotlib).
figures:
	$(PYTHON) -m nanospec.figures

# Every method at greedy, temperature 1 and 0.7 + top-p 0.9 on CUDA, greedy = ar, and the quick bench (needs out/).
# Without a GPU it says so and exits 0.
gpu-check:
	$(PYTHON) -m nanospec.gpu_check $(if $(CKPT),--ckpt $(CKPT))

# The course (EXERCISES.md): `make handout EX=3,4 OUT=../handout`, then `make grade` (EX=3,4 to choose).
# Over an earlier handout only the generated files change; OVERWRITE=1 also replaces those edited since.
handout:
	$(PYTHON) -m nanospec.course.handout --ex $(or $(EX),all) --out $(OUT) $(if $(OVERWRITE),--overwrite)

grade: deps
	$(PYTHON) -m nanospec.course.grade $(if $(EX),--ex $(EX))
