"""
The registry: every `--method` name maps to a module with the same three things,

    generate(models, prompt_ids, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None,
             **options) -> (ids, stats)
    NEEDS:   the model parts it cannot run without, beyond the target, e.g. ("draft",)
    USES:    the parts it uses when present, e.g. ("heads",) (nanospec/model/load.py lists the parts)
    OPTIONS: its own options, name -> options.Option(type, default, help, bounds or choices); decode.py turns
             each into a --kebab-case flag, and generate reads them with options.read_options (defaults and
             bounds are written only there)

`decode.py`, the benchmark and the tests all go through `METHODS`, and check a method with `check_method`. What
the methods share is nanospec/steps/ (the run record, the options, the verify steps, drafting a chain or a tree,
the draft-length rules); batched.py, beside them, decodes B prompts at once. A method never knows how its forwards
run: nanospec/fast/runtime.py wraps the models first.
"""
from nanospec.decoding import ar
from nanospec.decoding import prompt_lookup, jacobi, lookahead
from nanospec.decoding import speculative
from nanospec.decoding import mtp, medusa
from nanospec.decoding import eagle
from nanospec.decoding import parallelspec
from nanospec.decoding import early_exit
from nanospec.model.checkpoint import train_hint

MODULES = {
    "ar": ar,
    "prompt-lookup": prompt_lookup,
    "jacobi": jacobi,
    "lookahead": lookahead,
    "speculative": speculative,
    "mtp": mtp,
    "medusa": medusa,
    "eagle": eagle,
    "parallelspec": parallelspec,
    "early-exit": early_exit,
}
METHODS = {name: module.generate for name, module in MODULES.items()}


def parts_for(names):
    """The model parts the methods `names` need or use: what load_models should read for them."""
    modules = [MODULES[name] for name in names if name in MODULES]
    return tuple(dict.fromkeys(p for module in modules for p in module.NEEDS + module.USES))


def check_method(name, models=None, folder="out"):
    """A one-line ValueError if `name` is no method or, given its `models`, they lack a part it needs: named with
    the command that trains it into `folder`, the run folder the models came from. Every command checks a method
    here: decode.py, the bench, gpu-check."""
    if name not in MODULES:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(MODULES)}")
    for part in MODULES[name].NEEDS if models is not None else ():
        if getattr(models, part, None) is None:
            raise ValueError(f"--method {name} needs the {part} model, which {folder} lacks: "
                             f"{train_hint(part, folder)}")
