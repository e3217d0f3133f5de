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
    if name == "cuda" or name.startswith("cuda:"):
        index = name[len("cuda:"):] if name.startswith("cuda:") else "0"
        if not index.isdigit():
            raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N or mps")
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA GPU is visible here; use --device cpu or auto")
        if int(index) >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) here, cuda:0 .. "
                             f"cuda:{torch.cuda.device_count() - 1}")
        return name
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError("--device mps: Apple's MPS backend is not available here; use --device cpu or auto")
    if name not in ("cpu", "mps"):
        raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N or mps")
    return name
