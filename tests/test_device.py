"""Every tensor and random generator a method makes lives on the model's device: the GPU path, checked without a GPU.

A tensor made without naming a device lands on the default device. On a machine whose models sit on a GPU that
default is the CPU, and the first operation mixing it with the model's tensors fails ("Expected all tensors to be
on the same device"). A CPU-only test cannot see that, since there everything is on the CPU. So the models are
loaded on the CPU and each method runs under `torch.device("meta")` as the default device: any tensor made
without naming a device lands on `meta`. Mixing a meta tensor with CPU ones does not always fail (an embedding
or a gather with meta indices and CPU weights returns garbage on the CPU), so `on_meta_fails` turns every
torch call that takes or makes a meta tensor into an error: the models are on the CPU, so no tensor of a correct
run is ever on meta. Which tensors are made depends on the path a run takes (a tree with drawn children, an
empty draft, a rejection), so each setting runs over a few seeds, on both runtime paths: the models as they are
(eager) and wrapped by nanospec/fast/runtime.py (static: its masks, slots and buffers are made there too).

A `torch.Generator()` is not a factory the default device reaches, so generators get their own check: every
generator made during a run must name the model's device."""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from nanospec.decoding import METHODS
from nanospec.fast.runtime import prepare
from toys import every_part, random_ids, tiny_gpt

SAMPLINGS = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0),
             "t0.7-p0.9": dict(temperature=0.7, top_p=0.9)}
SEEDS = (0, 1, None)  # None: the run seeds its own generator


class on_meta_fails(TorchFunctionMode):
    """Inside `with torch.device("meta"), on_meta_fails():` any torch call that takes or returns a meta tensor
    raises, naming the call: the tensor was made without the model's device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves((args, kwargs, out))):
            raise RuntimeError(f"{getattr(func, '__name__', func)} met a tensor made without naming a device")
        return out


@pytest.fixture(scope="module")
def models():
    """Every part every method can use, tiny and random, on the CPU (context 48)."""
    return every_part(block_size=48)


@pytest.mark.parametrize("runtime", ["eager", "static"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("method", METHODS)
def test_method_makes_every_tensor_on_the_models_device(models, method, sampling, runtime):
    """Greedy takes one path whatever the seed: seed 0 and a seed of the run's own (None) only."""
    prompt, (wrapped, _) = random_ids(6, seed=3), prepare(models, runtime)
    for seed in SEEDS if sampling != "greedy" else (0, None):
        with torch.device("meta"), on_meta_fails():  # a tensor made without a device lands on meta, and fails
            ids, _ = METHODS[method](wrapped, prompt, 10, seed=seed, **SAMPLINGS[sampling])
        assert len(ids) == 10
        if seed is not None:  # the checked run is the ordinary (eager) run
            assert ids == METHODS[method](models, prompt, 10, seed=seed, **SAMPLINGS[sampling])[0]


@pytest.mark.parametrize("method", METHODS)
def test_method_makes_its_generator_on_the_models_device(models, method, monkeypatch):
    made = []  # the device each generator was asked for (None: not named, i.e. the CPU whatever the model)
    real = torch.Generator

    def recording(*args, **kwargs):
        made.append(kwargs.get("device", args[0] if args else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "Generator", recording)
    METHODS[method](models, random_ids(6, seed=3), 6, temperature=1.0, seed=0)
    assert made, "the run made no generator"
    model_device = models.target.wte.weight.device
    for device in made:
        assert device is not None and torch.device(device) == model_device, f"generator made for {device}"


def test_negative_control_a_cpu_tensor_is_caught():
    """The check has teeth: a tensor made without a device fails against the model's tensors under meta."""
    target = tiny_gpt(0)
    with torch.device("meta"), on_meta_fails(), pytest.raises(RuntimeError, match="without naming a device"):
        target(torch.tensor([[1, 2, 3]]))  # plain torch would return garbage logits on the CPU here
