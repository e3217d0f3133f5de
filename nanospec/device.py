"""Where a command runs: the torch device (`--device auto|cpu|cuda|cuda:N|mps`, with a one-line error for one that
is not here), a random generator whose every 63-bit seed is its own stream, and the terminal's edges (Ctrl-C, a
closed pipe, an encoding that cannot show the text). torch is imported only where it is needed, so that
`plain_exits` can run before the slow imports."""
import os
import sys

MAX_SEED = 2**63 - 1  # seeds are 0..MAX_SEED: what every generator (CPU, CUDA) takes as it is


def pick_device(name="auto"):
    """'auto' -> cuda, then mps, then cpu; a named device that is not there is a clear error."""
    import torch
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


def check_seed(seed, flag="--seed"):
    """A seed must be a whole number in 0..2**63-1; anything else is a one-line ValueError."""
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{flag} must be in 0..2**63-1 ({MAX_SEED}), got {seed}")


def seeded_generator(device, seed):
    """A torch.Generator on `device` seeded with `seed` (0..2**63-1), each seed its own stream.

    The CPU generator (a Mersenne Twister) keeps only the low 32 bits of manual_seed's argument, so seeds 0 and
    2**32 would draw the same numbers. A seed below 2**32 is seeded as manual_seed does it (the outputs of every
    seed in use stay as they were); a larger one fills the twister's 624 words of state from the whole seed, by
    numpy's SeedSequence (a hash made for this). CUDA's generator (Philox) takes all 64 bits as they are."""
    import numpy as np
    import torch
    check_seed(seed, "seed")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    if generator.device.type != "cpu" or seed < 2**32:
        return generator
    state = generator.get_state().numpy().copy()  # torch's CPU layout: seed (8 bytes), left, seeded (4 + 4),
    if state.size != 5056:                         # next (8), the 624 words (8 bytes each), then normal caches
        raise RuntimeError(f"unknown layout of torch {torch.__version__}'s CPU generator state: seeds of 2**32 "
                           f"or more cannot be told apart here; use a seed below 2**32")
    words = np.random.SeedSequence(seed).generate_state(624, np.uint32).astype("<u8")
    state[24:24 + 624 * 8] = np.frombuffer(words.tobytes(), dtype=np.uint8)
    state[8:12] = np.frombuffer(np.int32(1).tobytes(), dtype=np.uint8)  # left = 1, next = 0: the twister turns its
    state[16:24] = 0                                                     # state over before the first number
    generator.set_state(torch.from_numpy(state))
    return generator


def plain_exits():
    """The edges of the terminal, for a command-line entry point (call it first, before the slow imports):
    Ctrl-C ends with one line, 'interrupted' (exit status 130, as the shell expects); a reader that closed the
    pipe (`| head -1`) ends it quietly; text the terminal's encoding cannot show is escaped (caf\\xe9), not an
    error. Anything else still prints its traceback: that is a bug to report."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # a real text stream (not one a caller handed in)
            stream.reconfigure(errors="backslashreplace")
    default = sys.excepthook

    def hook(kind, error, trace):
        if issubclass(kind, KeyboardInterrupt):
            try:
                sys.stdout.flush()  # what was printed so far stays printed
            except Exception:  # noqa: BLE001 - a closed pipe: nothing more to show
                pass
            print("interrupted", file=sys.stderr, flush=True)
            os._exit(130)
        if issubclass(kind, BrokenPipeError):
            # stdout to /dev/null: the interpreter's last flush at exit would otherwise complain once more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            os._exit(0)
        default(kind, error, trace)
    sys.excepthook = hook
