"""Names kept where they were for code that has not moved yet (nanospec/bench.py, the course's tests). New code
imports from options.py (sampling, options), run.py (the run record, `tensor`) and chain_step.py."""
from nanospec.decoding.options import DRAFT_SAMPLING  # noqa: F401
from nanospec.decoding.run import tensor  # noqa: F401
