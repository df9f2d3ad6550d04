"""
What a person saw in the terminal during a run, from its console log (run.sh tees it to
run.console.log): the log replayed as a terminal draws it (a progress bar's redraws overwrite one
another, tqdm's cursor-up moves back to the run's bar), cut at the run bar's own clock: the screen
after the first N seconds, and the lines last drawn in the final N seconds.

    python results/first-run/console.py /tmp/whale-first-run/run.console.log            # 120 s each
    python results/first-run/console.py LOG --seconds 60

Left out: colours and any escape sequence but tqdm's cursor-up (the log holds no other).
"""
import argparse
import re
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's whale.py

from whale import METHODS  # noqa: E402  (the run's bar is "<method> <domain>: ...")

UP = "\x1b[A"
MAX_CHARS = 64 * 2**20  # a default run's log is ~70 KB
CLOCK = re.compile(rf"^(?:{'|'.join(map(re.escape, METHODS))}) \w+: .*\| \d+/\d+ \[(?:(\d+):)?(\d+):(\d+)<")


def replay(text):
    """[(row text, seconds on the run's clock when it was last drawn)], and the screen at each clock
    second first reached: {second: rows so far}."""
    rows, when, row, col, clock, screens = [""], [0], 0, 0, 0, {}
    for piece in re.split(r"(\n|\r|\x1b\[A)", text):
        if piece == "\n":
            row, col = row + 1, 0
            if row == len(rows):
                rows.append("")
                when.append(clock)
        elif piece == "\r":
            col = 0
        elif piece == UP:
            row = max(0, row - 1)
        elif piece:
            line = rows[row].ljust(col)
            rows[row], col, when[row] = line[:col] + piece + line[col + len(piece):], col + len(piece), clock
            m = CLOCK.match(rows[row].strip())
            if m:
                clock = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + int(m.group(3))
                screens.setdefault(clock, list(rows))
    return list(zip(rows, when)), screens


def main(argv=None):
    ap = argparse.ArgumentParser(description="A run's console as a terminal showed it: first and last N seconds.")
    ap.add_argument("log", help="the console log (run.sh time writes <run>.console.log)")
    ap.add_argument("--seconds", type=int, default=120, help="how much of the start and of the end to show")
    a = ap.parse_args(argv)
    try:
        with open(a.log, encoding="utf-8", errors="replace", newline="") as f:  # (keep the \r of the redraws)
            text = f.read(MAX_CHARS)  # (a log from elsewhere: read up to a bound, shown as text only)
    except OSError as e:
        print(f"console: error: {a.log}: {e.strerror}", file=sys.stderr)
        return 2
    rows, screens = replay(text)
    first = next((screens[s] for s in sorted(screens) if s >= a.seconds), [r for r, _ in rows])
    end = max((w for _, w in rows), default=0)
    show = lambda lines: "\n".join(x.rstrip() for x in lines if x.strip())  # noqa: E731
    print(f"== the first {a.seconds} s (the screen when the run's bar first read {a.seconds // 60}:{a.seconds % 60:02d})")
    print(show(first))
    print(f"\n== the last {a.seconds} s (the lines drawn after {max(end - a.seconds, 0) // 60}:"
          f"{max(end - a.seconds, 0) % 60:02d} on the run's bar, as they stand at the end)")
    print(show(r for r, w in rows if w >= end - a.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
