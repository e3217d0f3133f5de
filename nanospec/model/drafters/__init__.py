"""The drafters that are models of their own beside the target: EAGLE's one-layer head (eagle.py), early exit's
exit adapter (early_exit.py) and ParallelSpec's mask-token drafter (parallelspec.py). Their losses and training
stages are in nanospec/training/; the small draft GPT of `speculative` is a GPT (nanospec/model/gpt.py)."""
