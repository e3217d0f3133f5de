"""Shared test settings. Tiny models gain nothing from several threads, and on a shared 2-core machine extra
threads only fight each other: one thread per test process."""
import torch

torch.set_num_threads(1)
