"""`make setup`'s account of pip installing the lock, read from pip's output on stdin.

pip names each package as it takes it (a numbered line here), then unpacks 6.5 GB for minutes
without a word and ends on a 3,000-character list. Here a silence of 30 s gets a line saying
what pip is doing and for how long, and the list becomes a count. Standard library only: it
runs in the new .venv before anything is installed.

    pip install ... 2>&1 | python -m reprotrain.pip_progress --total 195
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from collections.abc import Iterable
from typing import TextIO


def clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def narrate(lines: Iterable[str], total: int, out: TextIO = sys.stdout, quiet_s: float = 30) -> None:
    start = time.monotonic()
    state = {"said": start, "doing": "pip is starting and reading requirements.lock"}
    lock = threading.Lock()

    def say(text: str) -> None:
        with lock:
            print(text, file=out, flush=True)
            state["said"] = time.monotonic()

    def keep_talking() -> None:
        while True:
            time.sleep(min(1.0, quiet_s / 4))
            if time.monotonic() - state["said"] >= quiet_s:
                say(f"  ... {state['doing']} ({clock(time.monotonic() - start)} so far)")

    threading.Thread(target=keep_talking, daemon=True).start()
    taken, kept, installed, failing = 0, 0, False, False
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith(("Collecting ", "Processing ")):
            taken += 1
            state["doing"] = "pip is checking the downloaded files against the lock's hashes"
            say(f"[{taken}/{total}] {re.sub(r' [(]from -r .*', '', line)}")
        elif line.startswith("Installing collected packages:"):
            count = line.count(",") + 1
            state["doing"] = f"pip is unpacking {count} packages into .venv"
            say(f"unpacking {count} packages into .venv: several minutes in which pip prints "
                f"nothing; a line every {quiet_s:g} s until it is done")
        elif line.startswith("Requirement already satisfied"):
            kept += 1
        elif line.startswith("Successfully installed"):
            installed = True
            say(f"installed {len(line.split()) - 2} packages in {clock(time.monotonic() - start)}")
        elif line.startswith("ERROR") or failing:  # pip's error and everything it adds
            failing = True
            say(line)
    if kept and not installed and not failing:  # a lock that changed only in its file's time
        say(f"nothing to install: the lock's {kept} packages are in .venv already")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", type=int, required=True, help="packages in the lock")
    narrate(sys.stdin, parser.parse_args().total)
