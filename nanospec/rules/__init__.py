"""The rules that keep decoding lossless, as pure functions on probability tensors: sampling and the verification
rules (verify.py), the slow references the tests hold them to (reference.py), and a tree's structure (tree.py).
They import no model, method or tokenizer."""
