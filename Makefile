# Thin targets: each runs one visible command. `make` alone lists them.
PYTHON ?= python
PRECISION ?= auto
PRESET ?= tiny
TIMEOUT ?= 300

# Every value given on the command line reaches the shell as one single-quoted word: OUT="/tmp/a b" is one path,
# and OUT="x;echo hi" is a strange folder name, never a second command.
quote = '$(subst ','\'',$(strip $(1)))'

.PHONY: help install deps train test bench bench-batch bench-quick gpu-check figures handout grade

# The first target, so that `make` alone lists the others; one printf, one write: `make | head -3` ends quietly.
help:
	@printf '%s\n' \
	    "make train         the corpus, tokenizer, target and every drafter into out/ (~10 min on 2 CPU cores)" \
	    "                   PRESET=gpu: the deep GPU preset, into out-gpu/; PRECISION=fp32: the README's figures" \
	    "make test          the test suite (~4 min on 2 cores)" \
	    "make bench         every method against ar, into bench_results.md (CKPT=out-gpu: another run folder)" \
	    "make bench-batch   batched ar, speculative and prompt-lookup at B = 1..32, into bench_batch.md" \
	    "make bench-quick   a smoke run of the bench" \
	    "make figures       the PNGs, into runs/figures/ (OUT=docs/figures: the README's; CKPT=out-gpu; needs matplotlib)" \
	    "make gpu-check     every method on CUDA, greedy = ar, and the quick bench" \
	    "make handout       a student copy of the course (EX=1-11 OUT=../handout)" \
	    "make grade         grade the exercises (EX=3,4 to choose; TIMEOUT=$(TIMEOUT) seconds per pytest run)" \
	    "make install       pip install -r requirements.txt"

install:
	$(PYTHON) -m pip install -r requirements.txt

# `make train`, `make test` and `make grade` install requirements.txt first, only if a package is missing
# (a torch you installed yourself, say a CUDA build, is kept).
deps:
	@$(PYTHON) -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in \
	('torch', 'numpy', 'tiktoken', 'pytest', 'hypothesis')))" || $(PYTHON) -m pip install -r requirements.txt

train: deps  # PRECISION=fp32: the reference every README figure names; PRESET=gpu: one H100, ~5 min, into out-gpu/
	$(PYTHON) train_tiny.py --preset $(call quote,$(PRESET)) --precision $(call quote,$(PRECISION))

test: deps
	$(PYTHON) -m pytest

bench:  # CKPT=out-gpu: the gpu preset's checkpoints
	$(PYTHON) -m nanospec.bench $(if $(CKPT),--ckpt $(call quote,$(CKPT)))

bench-batch:  # batched ar, speculative and prompt-lookup at B = 1..32 (nanospec/bench/batch.py)
	$(PYTHON) -m nanospec.bench --batch-sizes 1,2,4,8,16,32 $(if $(CKPT),--ckpt $(call quote,$(CKPT)))

bench-quick:
	$(PYTHON) -m nanospec.bench --quick $(if $(CKPT),--ckpt $(call quote,$(CKPT)))

# The PNGs from out/ (CKPT=out-gpu: another run folder) and bench_results.json (needs matplotlib: pip install
# matplotlib), into runs/figures/, which git ignores; `make figures OUT=docs/figures` replaces the README's own.
# trace.png, the trace page's screenshot, needs chromium (apt-get install chromium), and is skipped without it.
figures:
	$(PYTHON) -m nanospec.bench.figures $(if $(CKPT),--ckpt $(call quote,$(CKPT))) $(if $(OUT),--out $(call quote,$(OUT)))

# Every method at greedy, temperature 1 and 0.7 + top-p 0.9 on CUDA, greedy = ar, and the quick bench (needs out/).
# Without a GPU: the same checks on the CPU, the static path's CUDA-graph replay emulated (nanospec/fast/graphs.py).
gpu-check:
	$(PYTHON) -m nanospec.gpu_check $(if $(CKPT),--ckpt $(call quote,$(CKPT)))

# The course (EXERCISES.md): `make handout EX=3,4 OUT=../handout`, then `make grade` (EX=3,4 to choose).
# Over an earlier handout only the generated files change; OVERWRITE=1 also replaces those edited since
# (OVERWRITE=0, or none, means no; any other value is refused, never taken for a yes).
overwrite = $(if $(filter 1 yes true,$(OVERWRITE)),--overwrite,$(if $(filter-out 0 no false,$(OVERWRITE)),\
    $(error OVERWRITE=$(OVERWRITE): say OVERWRITE=1 to replace edited files, or leave it out)))

handout:
	$(PYTHON) -m nanospec.course.handout --ex $(call quote,$(or $(EX),all)) \
	    --out $(call quote,$(or $(OUT),../nanospec-handout)) $(overwrite)

# Each pytest run may take TIMEOUT seconds; after one that runs out, one more run without the exercise that hung.
grade: deps
	$(PYTHON) -m nanospec.course.grade $(if $(EX),--ex $(call quote,$(EX))) --timeout $(call quote,$(TIMEOUT))
