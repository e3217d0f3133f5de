"""decode.py --color: each target forward's accepted guesses in green, then the target's own token (cyan or yellow,
alternating), checked against the method's own stats; plain [brackets] when not asked for or not on a terminal.
The run folder is conftest.py's `ckpt` (a byte-level tokenizer, a random tiny target with MTP heads)."""
import json
import re

import decode

ARGS = ["--device", "cpu", "--max-new-tokens", "24", "--prompt", "def f(x):\n    return x"]
SPAN = re.compile(r"\x1b\[30;(4[236])m(.*?)\x1b\[0m", re.S)  # (background, text) of each coloured span


def test_colour_marks_guesses_and_the_targets_tokens(ckpt, capsys):
    """prompt-lookup on a repetitive prompt: the guessed spans and the target's own spans follow the stats."""
    decode.main(["--ckpt", ckpt, *ARGS, "--method", "prompt-lookup", "--json"])
    stats = json.loads(capsys.readouterr().out)["stats"]
    decode.main(["--ckpt", ckpt, *ARGS, "--method", "prompt-lookup", "--color", "always"])
    out = capsys.readouterr().out
    assert decode.LEGEND in out
    text = out.split(decode.LEGEND)[0]  # the continuation, without the legend's own colours
    spans = SPAN.findall(text)
    own = [bg for bg, _ in spans if bg != "42"]
    assert len(own) == sum(1 for kept, g in zip(stats["accepted_per_step"], stats["guesses_per_step"]) if kept > g)
    assert own == ["46", "43"] * (len(own) // 2) + ["46"] * (len(own) % 2)  # alternating forward by forward
    assert sum(1 for bg, _ in spans if bg == "42") == sum(1 for g in stats["guesses_per_step"] if g)
    assert sum(stats["guesses_per_step"]) > 0, "the prompt must make the lookup guess"


def test_brackets_unless_asked(ckpt, capsys):
    """Not a terminal (pytest captures): brackets, one pair per forward, no escape codes; --color never too."""
    for extra in ([], ["--color", "never"]):
        decode.main(["--ckpt", ckpt, *ARGS, "--method", "ar", *extra])
        out = capsys.readouterr().out
        assert "\x1b[" not in out and out.count("[") - out.count("[runtime") == 24
