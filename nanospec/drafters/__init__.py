"""Trained drafters that read the target: the EAGLE feature head and the ParallelSpec mask-token drafter."""
