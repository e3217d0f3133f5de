"""nanospec: parallel and speculative decoding from scratch, in plain PyTorch."""
