"""The steps the decoding methods share: the verify step over a chain or a tree of guesses (verify_step.py), a
drafter's chain of guesses (draft_chain.py), which tokens fill a tree (tree_guesses.py), the run record and what
every method sets up alike (run.py), the sampling settings, every method's options and the verification rules by
name (options.py), and the draft-length rules (adaptive.py, with the cost rule's books in pricing.py). Each is
written once and called by every method that needs it; none calls back into a method."""
