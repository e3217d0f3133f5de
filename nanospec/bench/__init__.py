"""Measurement: the bench of every method (compare.py, `python -m nanospec.bench`), batched decoding's bench
(batch.py), the Markdown report (report.py), the figures (figures.py), the timed and counted models the bench
wraps around the parts (timing.py), and the calibration the cost rule prices steps with (calibration.py)."""
