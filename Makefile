# Thin targets: each runs one visible command.
PYTHON ?= python

.PHONY: install train test bench bench-quick

install:
	$(PYTHON) -m pip install -r requirements.txt

train:
	$(PYTHON) train_tiny.py

test:
	$(PYTHON) -m pytest

bench:
	$(PYTHON) -m nanospec.bench

bench-quick:
	$(PYTHON) -m nanospec.bench --quick
