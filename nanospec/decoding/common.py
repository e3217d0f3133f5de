"""Names kept where they were for code that has not moved yet (nanospec/bench.py, the course's tests). New code
imports from run.py (the run record, sampling and options) and chain_step.py (the chain verify step)."""
from nanospec.decoding.run import DRAFT_SAMPLING, tensor  # noqa: F401
