"""Rebuild data/chess/*.jsonl.gz from BIG-bench `checkmate_in_one` (Apache-2.0).

The 3,500 games of checkmate_in_one ship inside the PyPI sdist bigbench==1.0.0; we read the task.json member
with tarfile (the package is never installed). Each game is a SAN move list that stops one move before mate,
and its target is the mating move. From every game we cut up to two puzzles:

  mate-in-1  the position before the mating move; solution = [mate]. Kept only if exactly ONE legal move mates.
  mate-in-2  the position two plies earlier; solution = [our move, the game's reply, the game's mate].
             Kept only if exact search proves our move is the UNIQUE move that forces mate in 2:
             the position has no mate in 1, after our move EVERY legal reply allows a mate in 1 (and there is at
             least one reply, so no stalemate), and no other legal move has that property. Because every reply
             loses, the environment may play the stored reply; the verifier accepts any mating final move.

The search is python-chess (GPL-3.0+, used as a library) plus two short functions below: a mate in 1 must give
check, so only checking moves are pushed. That keeps the build at ~20 ms per game (~1.5 minutes in all).

Splits are cut by GROUP, not by puzzle: the mate-in-2 line of a game passes through its mate-in-1 position, so
a game and every game sharing a position with it form one group, and a group never straddles two splits;
duplicate positions are kept once. Groups are ordered by a sha256 of their first position (stable across Python
versions); test, val and harness take one puzzle per group up to exact (mate-in-1, mate-in-2) counts; all
other groups are the weight pool. Files are gzip with mtime=0 and no file name, so a rebuild is byte-identical
(given the same zlib).

Usage: python data/build_chess.py [--src bigbench-1.0.0.tar.gz] [--out data/chess]
Leaves out: mate in 3 and longer (stepping further back works the same way, but each extra move multiplies the
exact search by ~1000 positions, and many game lines stop being forced).
"""
import argparse
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile

import chess

SDIST = "bigbench-1.0.0.tar.gz"
MEMBER = "bigbench-1.0.0/bigbench/benchmark_tasks/checkmate_in_one/task.json"
# (mate-in-1, mate-in-2) per evaluation split; mate-in-2 is over-weighted (~40%) so the multi-move case counts
SIZES = {"test": (150, 100), "val": (60, 40), "harness": (77, 51)}
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chess")


def find_sdist(src):
    """Return a path to the sdist: --src, a copy in /tmp, or a fresh `pip download` into /tmp/dl."""
    for path in [src, f"/tmp/{SDIST}", f"/tmp/dl/{SDIST}"]:
        if path and os.path.exists(path):
            return path
    os.makedirs("/tmp/dl", exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "-d", "/tmp/dl", "bigbench==1.0.0"], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"build_chess: {SDIST} sdist not found: the package index no longer serves bigbench==1.0.0 "
                 "(it answers 'from versions: 0.0.1', 2026-12-06); data/chess/ stands as committed "
                 "(data/README.md); with a copy of the sdist (its sha256 is there), pass --src PATH")
    return f"/tmp/dl/{SDIST}"


def read_games(sdist):
    """[(movetext, target_san)] in source order, from the task.json member of the sdist."""
    with tarfile.open(sdist) as tf:
        task = json.load(tf.extractfile(MEMBER))
    return [(ex["input"], ex["target"]) for ex in task["examples"]]


def replay(movetext):
    """Board after a SAN movetext like '1. e4 e5 2. Qh5 Nc6 3.' (move numbers are skipped)."""
    board = chess.Board()
    for tok in movetext.split():
        if not re.fullmatch(r"\d+\.+", tok):
            board.push_san(tok)
    return board


def mating_moves(board):
    """All legal moves that checkmate at once. Only checking moves can mate, so test those only."""
    found = []
    for move in board.generate_legal_moves():
        if board.gives_check(move):
            board.push(move)
            if board.is_checkmate():
                found.append(move)
            board.pop()
    return found


def has_mate_in_1(board):
    for move in board.generate_legal_moves():
        if board.gives_check(move):
            board.push(move)
            mate = board.is_checkmate()
            board.pop()
            if mate:
                return True
    return False


def forces_mate_in_2(board, move):
    """True iff after `move` the opponent has a legal reply and EVERY reply allows a mate in 1."""
    board.push(move)
    try:
        replies = list(board.generate_legal_moves())
        if not replies:  # mate (then it was a mate in 1) or stalemate: not a mate in 2 either way
            return False
        for reply in replies:
            board.push(reply)
            ok = has_mate_in_1(board)
            board.pop()
            if not ok:
                return False
        return True
    finally:
        board.pop()


def puzzle(pid, board, line):
    task = {"fen": board.fen(), "plies": len(line), "side": "white" if board.turn == chess.WHITE else "black"}
    return {"id": pid, "task": task, "answer": {"line": [m.uci() for m in line]}}


def puzzles_of_game(index, movetext, target):
    """Up to two puzzles of one game, plus the epd keys of every position its lines pass through."""
    board = replay(movetext)
    mate = board.parse_san(target)
    board.push(mate)
    assert board.is_checkmate(), f"game {index}: target {target} does not mate"
    board.pop()
    out, keys = [], [board.epd()]
    if len(mating_moves(board)) == 1:
        out.append(puzzle(f"chess-m1-{index:04d}", board, [mate]))
    if len(board.move_stack) >= 2:
        reply = board.pop()
        ours = board.pop()
        keys.append(board.epd())
        if (not has_mate_in_1(board) and forces_mate_in_2(board, ours)
                and not any(forces_mate_in_2(board, m) for m in board.generate_legal_moves() if m != ours)):
            out.append(puzzle(f"chess-m2-{index:04d}", board, [ours, reply, mate]))
    return out, keys


def group_puzzles(games):
    """Union games that share any position (union-find over epd keys); drop duplicate puzzle positions."""
    parent = {}

    def root(k):
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    for _, keys in games:
        for k in keys[1:]:
            parent[root(k)] = root(keys[0])
    groups, seen = {}, set()
    for puzzles, keys in games:
        for p in puzzles:
            key = chess.Board(p["task"]["fen"]).epd()
            if key not in seen:
                seen.add(key)
                groups.setdefault(root(keys[0]), []).append(p)
    return [g for g in groups.values() if g]


def split(groups):
    """Order groups by a hash; test/val/harness take ONE puzzle per group (its mate-in-2 while those are still
    needed, else its mate-in-1) up to exact counts; the group's other puzzle is dropped, not moved to weight,
    where it would leak the last move of an evaluation line. Every remaining group is the weight pool."""
    order = sorted(groups, key=lambda g: hashlib.sha256(g[0]["task"]["fen"].encode()).hexdigest())
    splits, used = {}, set()
    for name, (n1, n2) in SIZES.items():
        rows, need = [], {1: n1, 3: n2}
        for i, g in enumerate(order):
            fits = [p for p in sorted(g, key=lambda p: -p["task"]["plies"]) if need[p["task"]["plies"]] > 0]
            if i not in used and fits:
                used.add(i)
                rows.append(fits[0])
                need[fits[0]["task"]["plies"]] -= 1
        assert need == {1: 0, 3: 0}, f"{name}: not enough puzzles, still need {need}"
        splits[name] = rows
    splits["weight"] = [p for i, g in enumerate(order) if i not in used for p in g]
    return splits


def write_jsonl_gz(path, rows):
    raw = "".join(json.dumps(r) + "\n" for r in rows).encode()
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(raw)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=None, help=f"path to {SDIST} (else /tmp, else pip download)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    games = read_games(find_sdist(args.src))
    cut = [puzzles_of_game(i, text, target) for i, (text, target) in enumerate(games)]
    splits = split(group_puzzles(cut))
    os.makedirs(args.out, exist_ok=True)
    for name, rows in splits.items():
        write_jsonl_gz(os.path.join(args.out, f"{name}.jsonl.gz"), rows)
        n2 = sum(r["task"]["plies"] == 3 for r in rows)
        print(f"{name:8s} {len(rows):5d} puzzles ({len(rows) - n2} mate-in-1, {n2} mate-in-2)")


if __name__ == "__main__":
    main()
