# Thin targets: each runs one visible command.
PYTHON ?= python

.PHONY: install train test

install:
	$(PYTHON) -m pip install -r requirements.txt

train:
	$(PYTHON) train_tiny.py

test:
	$(PYTHON) -m pytest
