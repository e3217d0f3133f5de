"""Which torch device to run on: `--device auto|cpu|cuda|cuda:N|mps`, with a one-line error for one that is not here."""
import torch


def pick_device(name="auto"):
    """'auto' -> cuda, then mps, then cpu; a named device that is not there is a clear error."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible here; use --device cpu or auto")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError("--device mps: Apple's MPS backend is not available here; use --device cpu or auto")
    if name not in ("cpu", "cuda", "mps") and not name.startswith("cuda:"):
        raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda or mps")
    return name
