"""The models: the GPT with its MTP heads and KV cache (gpt.py), the drafters' own modules (drafters/), and how a
checkpoint becomes models on a device (checkpoint.py saves and reads files, load.py gathers the parts a method
needs). Nothing here knows a decoding method, a rule, the bench or the trainer."""
