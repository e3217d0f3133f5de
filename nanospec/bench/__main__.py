"""`python -m nanospec.bench`: every method side by side (compare.py holds the bench, report.py writes it)."""
from nanospec.device import plain_exits

plain_exits()  # first, before torch loads: Ctrl-C, a closed pipe and the terminal's encoding end plainly

from nanospec.bench.compare import main  # noqa: E402

main()
