"""The trained drafters that read the target: each file holds one drafter's model, its loader and the losses it
learns from (heads, eagle, parallelspec, early_exit); training.py holds their training stages, which only
training imports."""
