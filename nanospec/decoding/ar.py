"""
`ar`: plain autoregressive decoding, one token per target forward. The reference every other method must
reproduce: token for token under greedy decoding, in distribution under sampling.

Each step feeds the last token to the model, which attends to the KV cache of everything before it:
    prompt [12, 7, 40] -> forward over all 3 (prefill) -> 88;  forward [88] -> 5;  forward [5] -> ...

`generate_nocache` is the slow, obvious path: a full forward over the whole sequence for every token, no cache.
It is kept as the oracle that the cached path (and through it every fast method) is tested against.
"""
import torch

from nanospec.steps.options import Sampling, read_options
from nanospec.steps.run import first_token, new_run, plain_steps, tensor

NEEDS = ()  # model parts beyond the target
USES = ()  # parts used when present
OPTIONS = {}  # method-specific options: name -> Option(type, default, help, ...)


@torch.inference_mode()
def generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None, **options):
    read_options(OPTIONS, options)
    run = new_run(models, prompt_ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed)
    cache = models.target.new_cache()
    first_token(run, models.target, cache)  # one forward over the whole prompt (the prefill) -> the first token
    plain_steps(run, models.target, cache)  # then one forward per token, over the newest one alone
    return run.out, run.stats()


@torch.inference_mode()
def generate_nocache(target, prompt_ids, max_new_tokens):
    """Greedy decoding the slow way: recompute the whole sequence for every token."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        if len(ids) >= target.config.block_size:
            break
        logits = target(tensor(ids, target.wte.weight.device)).logits[0, -1]  # (V,)
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]
