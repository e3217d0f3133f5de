"""
Headless Chromium (Debian's `chromium` package), for the one thing here that needs a real browser: the trace page
(nanospec/trace/page.html). tests/test_trace.py opens it and reads the DOM its script built; `make figures` takes
its screenshot for the README. No driver and no Python package: the browser's own command-line modes.

    dom, console = dump_dom("run.html")                 # the page after its script ran; every console line
    console = screenshot("run.html#step=5", "trace.png")  # the page as a 1400 x 900 window shows it

Every run gets a fresh profile in a temporary folder, and flags that keep the browser from the network and from
anything it would do on its own (updates, sync, first-run pages). `--enable-logging=stderr` makes it print each
console message, an uncaught error included, as an `INFO:CONSOLE` line; those lines come back as `console`.
"""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0")
INSTALL = "install Chromium: apt-get install -y chromium (Debian; .ci/run does it)"


def find():
    """The chromium executable, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def url(path):
    """A file path, with an optional #fragment (run.html#step=5), as the file:// URL the browser opens."""
    path, _, fragment = str(path).partition("#")
    return Path(os.path.abspath(path)).as_uri() + (f"#{fragment}" if fragment else "")


def run(page, *flags, timeout=60):
    """Open `page` (a path, maybe with #fragment) headless with `flags`; returns (standard output, console lines).
    A RuntimeError with one line when Chromium is missing or fails."""
    exe = find()
    if exe is None:
        raise RuntimeError(f"no chromium on this machine: {INSTALL}")
    with tempfile.TemporaryDirectory(prefix="nanospec-chromium-") as profile:
        try:
            done = subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", *flags, url(page)], capture_output=True,
                                  text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"chromium did not finish with {page} in {timeout} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"chromium failed on {page} (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return done.stdout, [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


def dump_dom(page, timeout=60):
    """The page's DOM as HTML once it has loaded and its script has run, and the console lines it printed."""
    return run(page, "--dump-dom", timeout=timeout)


def screenshot(page, png, size=(1400, 900), timeout=60):
    """A PNG of the page in a window of `size` pixels, written to `png` (whole or not at all); returns the console
    lines."""
    png = os.path.abspath(png)
    tmp = f"{png}.tmp{os.getpid()}.png"
    try:
        _, console = run(page, f"--screenshot={tmp}", f"--window-size={size[0]},{size[1]}", timeout=timeout)
        if not os.path.exists(tmp):
            raise RuntimeError(f"chromium wrote no screenshot of {page}")
        os.replace(tmp, png)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return console
