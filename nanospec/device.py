"""Where a command runs: the torch device (`--device auto|cpu|cuda|cuda:N|mps`, with a one-line error for one that
is not here), its CPU threads (`--threads`), a random generator whose every 63-bit seed is its own stream, and the
terminal's edges (Ctrl-C, a closed pipe, an encoding that cannot show the text). torch is imported only where it
is needed, so that `plain_exits` can run before the slow imports."""
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


# Decoding runs on one torch thread unless told otherwise: a model this size (a 0.6M-parameter target, batch 1)
# does too little per operation to share it between threads, and where anything else keeps a core busy the
# threads of each operation wait on each other. Measured on a 2-core EPYC VM, two `python -c "while 1: pass"`
# beside it: one target forward took 0.45 s with torch's default (2 threads) and 0.0035 s with one; quiet, the
# README's first example took 0.10 s either way. The bench fixes one thread too; training adapts to the load
# (nanospec/training/trainer.py, threads_for), since its large batches do gain from a second core.
DECODE_THREADS = 1
THREADS_HELP = ("torch CPU threads, 0..this machine's cores (default 1: a model this size decodes fastest on one, "
                "and on a busy machine more threads wait on each other; 0 = torch's default, one per core)")


def add_threads_flag(parser):
    """--threads, as every command that decodes takes it (decode.py, gpu-check, the figures, the bench)."""
    parser.add_argument("--threads", type=int, default=DECODE_THREADS, help=THREADS_HELP)


def add_runtime_flag(parser, runtimes, more=""):
    """--runtime, as decode.py and the bench take it: runtimes = nanospec/fast/runtime.py's RUNTIMES (auto first);
    `more`, what the command adds to its help."""
    parser.add_argument("--runtime", default=runtimes[0], choices=runtimes,
                        help="how the models' forwards run (nanospec/fast/runtime.py wraps the models once): eager = "
                             "plain PyTorch; static = shape-static forwards, replayed from CUDA graphs on CUDA; auto "
                             f"(default) = static on CUDA, eager elsewhere{more}")


def set_threads(threads, flag="--threads"):
    """Set torch's CPU threads for decoding: threads (0 = torch's default, one per core), checked against the
    machine's cores with a one-line ValueError. Returns the number torch now uses."""
    import torch
    cores = os.cpu_count() or 1
    if threads is None or not 0 <= threads <= cores:  # more threads than cores only wait; a huge number crashes
        raise ValueError(f"{flag} must be in 0..{cores} (this machine's cores; 0 = torch's default), got {threads}")
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


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


class KeepGoing:
    """Standard output for a command whose work is its files (training, the figures): a reader that goes away
    (`| head -1`) ends the printing, not the work. The first write to the closed pipe sends the rest to
    /dev/null, quietly; everything else is the stream's own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.gone()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.gone()

    def gone(self):
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())  # what is still buffered goes there too

    def __getattr__(self, name):
        return getattr(self.stream, name)


def plain_exits(keep_going=False):
    """The edges of the terminal, for a command-line entry point (call it first, before the slow imports):
    Ctrl-C ends with one line, 'interrupted' (exit status 130, as the shell expects); a reader that closed the
    pipe (`| head -1`) ends it quietly, or with keep_going (a command whose work is its files: training, the
    figures) only its printing ends, quietly, and the work goes on to the end; text the terminal's encoding
    cannot show is escaped (caf\\xe9), not an error. Anything else still prints its traceback: that is a bug to
    report."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # a real text stream (not one a caller handed in)
            stream.reconfigure(errors="backslashreplace")
    if keep_going and hasattr(sys.stdout, "fileno"):
        sys.stdout = KeepGoing(sys.stdout)
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
