"""chess: solve mate-in-1 and mate-in-2 puzzles move by move against an environment that plays the opponent.

Data (data/chess/, built by data/build_chess.py from BIG-bench checkmate_in_one, Apache-2.0): positions cut
from 3,500 real games one ply (mate in 1) or three plies (mate in 2) before mate; exact search proved the first
move unique. Every split mixes both kinds (test 150 + 100, val 60 + 40, harness 77 + 51, weight the rest).
An example is {"id", "task": {"fen", "plies": 1|3, "side": "white"|"black"}, "answer": {"line": [uci, ...]}}.
The paper uses Lichess puzzles of 1-9 plies; BIG-bench ships games inside a pip package, so we derive our own.

The environment lives in the PARENT. make_tools(example) gives one rollout its own board and these tools:
    fen() -> str                  the position in FEN
    board() -> str                python-chess's ASCII board (rank 8 on top, White in capitals, "." empty)
    legal_moves() -> [uci]        the legal moves, sorted
    legal_moves_san() -> [san]    the same moves in the same order in SAN ("Nf3", "exd5", "O-O", "Qh7+")
    play(uci) -> str              make a move (below)
play(uci): the argument must be a UCI string ("e2e4", "e7e8q"; whitespace and case forgiven) that the model's
latest reply names (below). Anything else raises ValueError: the harness sees a tool error, nothing is played,
and it may try again. An ILLEGAL move,
or a legal move that is not the solution's, ENDS the rollout: play returns "over: ..." and every later play
call raises. A correct move is made, the environment answers with the opponent's reply from the stored line and
returns "ok: the opponent replied <uci>"; the last move returns "solved: ...". The first move must equal the
solution's (it was proved unique); the final move is accepted if it mates, whichever mate it is.
verify(example, answer, state) is 1.0 iff state.solved: the answer string is ignored, the board is the record.

Why "the harness may not choose moves" holds, and where it is only a rule:
- A harness may import only the standard library: meta_harness checks its imports, and the sandbox's child
  cannot read site-packages, so even a disguised `import chess` fails there (ModuleNotFoundError). All the
  harness learns about the position comes through the tools above.
- play() is a move budget: only legal moves count, the first wrong one ends the puzzle, so a harness gets at
  most len(line) // 2 + 1 counted moves (1 or 2) and cannot search by trial and error.
- The model names every move: under rollout.run, play() takes only a move that the rollout's latest llm() reply
  names (`named_in`: its UCI, also "e2-e4" or "e2 e4" in any case, or its SAN as a word of its own, check marks
  optional; "e7e8" names the queen promotion), else it raises ValueError and nothing is played. So a harness
  cannot play a move it picked out of the legal list, computed itself, or took from an older reply.
- The model is not led to a move: play() also refuses a move that the prompt of that same call singled
  out (singled_out): a prompt may name a list of moves only as the parent orders them (sorted UCI, or
  forcing moves first), all of them or at least the first 8, with no move named more often than most
  or put ahead of its place; a retry may list the moves of the piece the model named. So a harness that
  works the mate out itself (a move generator in pure Python) and shows the model that move alone, first,
  or twice, gets "play: led: ..." and nothing is played. Tested with such a harness and with every list on
  the menu (tests/test_domains.py).
- What the checks cannot see: which of the moves a reply names the harness plays (a reply that lists five
  moves names five: reading the first is parsing, picking the best would be choosing), which reply of
  llm(..., n=k) it takes, prose that points at a move without naming it, a hint written into a model turn
  in the model's name, and a harness that picks which fair list to show from a move generator of its own.
  The proposer rules forbid choosing, leading and move generators (the model chooses every move): there
  they are a rule for proposers, not a wall (read the candidates' diffs). Tools called outside
  rollout.run (the parent's own tests) have no model to check against and skip both checks.
- legal_moves_san() writes a mating move with "+", never "#": "#" would hand a harness the answer to every
  mate in 1 (and the last move of every mate in 2) without the model. Checks and captures stay visible: that
  is plain notation a chess GUI shows, and pointing the model at forcing moves is a fair harness idea.
Left out: longer puzzles, draws/stalemates as outcomes, partial credit.
"""
import functools
import gzip
import json
import os
import re
import types

import chess

from domains import check_records

NAME = "chess"
HERE = os.path.dirname(os.path.abspath(__file__))
# $WHALE_DATA points at another data root holding chess/; default: the repo's data/
DATA = os.path.join(os.environ.get("WHALE_DATA") or os.path.join(os.path.dirname(HERE), "data"), "chess")
H0 = os.path.join(HERE, "chess_h0.py")
SPLITS = ("weight", "harness", "val", "test")
# chess's own run size (whale.py's flags; the command line overrides them): a chess rollout costs ~3x a
# searchqa one (multi-turn, ~700-token boards), so the default run is smaller to finish in 20 minutes
# here, by the rule results/first-run/README.md wrote down before the run ("Chess's own defaults").
DEFAULTS = {"budget": 640, "schedule": "fixed-steps:2,2", "harness_examples": 32, "val_limit": 8, "test_limit": 75}


def load_split(split):
    """test 250, val 100, harness 128, weight 3,637 puzzles."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    path = os.path.join(DATA, f"{split}.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return check_records(records, path, ("fen", "plies", "side"), ("line",))


# ---------------------------------------------------------------- the environment (parent side)

def make_tools(example):
    """A fresh board for one rollout; the returned state is what verify reads."""
    # latest_replies: None here (no model in the loop); rollout.run sets it to the texts of the rollout's latest
    # llm() call, and play() then takes only a move those texts name
    # latest_prompt: the same call's messages; play() refuses a move they single out (singled_out)
    state = types.SimpleNamespace(board=chess.Board(example["task"]["fen"]), line=list(example["answer"]["line"]),
                                  solved=False, failed=False, played=[], bad_calls=0, latest_replies=None,
                                  latest_prompt=None)
    board = state.board

    def fen():
        return board.fen()

    def ascii_board():
        return str(board)

    def legal_moves():
        return sorted(m.uci() for m in board.legal_moves)

    def legal_moves_san():
        sans = [board.san(chess.Move.from_uci(u)) for u in legal_moves()]
        return [s[:-1] + "+" if s.endswith("#") else s for s in sans]  # never reveal mate (see docstring)

    def play(uci):
        if state.solved or state.failed:
            raise RuntimeError("the puzzle is over; no more moves")
        try:
            move = chess.Move.from_uci(uci.strip().lower())
        except (AttributeError, ValueError):  # not a string, or not UCI: a format error, nothing is played
            state.bad_calls += 1
            raise ValueError(f"play expects one move in UCI notation like 'e2e4' or 'e7e8q', got {repr(uci)[:40]}")
        if state.latest_replies is not None and not named_in(move, board, state.latest_replies):
            state.bad_calls += 1
            raise ValueError(f"play: the model's latest reply does not name {move.uci()}; the model chooses every "
                             f"move (write it as UCI like 'e2e4' or SAN like 'Nf3' in its reply)")
        why = singled_out(move, board, state.latest_prompt) if state.latest_prompt is not None else None
        if why:
            state.bad_calls += 1
            raise ValueError(f"play: led: {why}; the model chooses among the legal moves as the parent orders them "
                             f"(all of them, a class of them or the first of them), nothing is played")
        state.played.append(move.uci())
        if move not in board.legal_moves:
            state.failed = True
            return f"over: {move.uci()} is illegal in this position; the puzzle is lost"
        ply = 2 * (len(state.played) - 1)  # our moves sit at even plies of the line
        last = ply == len(state.line) - 1
        board.push(move)
        if last and board.is_checkmate():
            state.solved = True
            return f"solved: {move.uci()} is checkmate"
        if last or move.uci() != state.line[ply]:
            state.failed = True
            return f"over: {move.uci()} is not the solution; the puzzle is lost"
        reply = chess.Move.from_uci(state.line[ply + 1])
        board.push(reply)
        return f"ok: the opponent replied {reply.uci()}"

    tools = {"fen": fen, "board": ascii_board, "legal_moves": legal_moves,
             "legal_moves_san": legal_moves_san, "play": play}
    return tools, state


def named_in(move, board, texts) -> bool:
    """Whether one of texts names `move` (a chess.Move) as a word of its own: its UCI in any case, the
    squares optionally split by "-", "x" or a space ("e2e4", "E2-E4"; "e7e8" for "e7e8q": a pawn on the last
    rank is read as a queen, as boards do), or, for a legal move, its SAN ("Nxe5", "Qh7+", "O-O" or "0-0",
    a check or mate mark optional). "e4" inside "e2e4" is not the word "e4"."""
    uci = move.uci()
    squares = re.escape(uci[:2]) + r"[-x ]?" + re.escape(uci[2:4])
    promotion = re.escape(uci[4:]) + ("?" if uci[4:] == "q" else "")
    if any(re.search(rf"(?<![a-z0-9]){squares}{promotion}(?![a-z0-9])", t.lower()) for t in texts):
        return True
    if move not in board.legal_moves:
        return False
    san = board.san(move).rstrip("+#")
    forms = [re.escape(san)] + ([re.escape(san.replace("O", "0"))] if san.startswith("O-O") else [])
    return any(re.search(rf"(?<![A-Za-z0-9-])(?:{'|'.join(forms)})(?![A-Za-z0-9=-])", t) for t in texts)


def mentions(texts, board):
    """{legal move: (times named, position of its first naming)} over texts read as one, for every
    legal move texts name as named_in reads a name: its UCI, or its SAN. A pawn push's SAN is a bare
    square ("e4"), which any text about squares names ("knight b1 to a3"), so a bare square counts
    only in texts that write no legal move in UCI (a SAN-only list)."""
    return _mentions("\n".join(texts), board.fen())


@functools.lru_cache(maxsize=1024)
def _sans(fen):
    """{uci: SAN} of the position's legal moves (SAN is slow to write; a rollout asks again and again)."""
    board = chess.Board(fen)
    return {m.uci(): board.san(m) for m in board.legal_moves}


@functools.lru_cache(maxsize=1024)
def _mentions(text, fen):
    found, low = {}, text.lower()
    for uci, san in _sans(fen).items():
        san = san.rstrip("+#")
        by_uci = [m.start() for m in re.finditer(
            rf"(?<![a-z0-9]){re.escape(uci[:2])}[-x ]?{re.escape(uci[2:4])}{re.escape(uci[4:])}"
            rf"{'?' if uci[4:] == 'q' else ''}(?![a-z0-9])", low)]
        by_san = [m.start() for m in re.finditer(rf"(?<![A-Za-z0-9-]){re.escape(san)}(?![A-Za-z0-9=-])", text)]
        found[uci] = (by_uci, by_san, re.fullmatch(r"[a-h][1-8]", san) is not None)
    any_uci = any(u for u, _, _ in found.values())
    out = {}
    for uci, (by_uci, by_san, square) in found.items():
        hits = by_uci + (by_san if not (square and any_uci) else [])
        if hits:
            out[uci] = (len(hits), min(hits))
    return out


def singled_out(move, board, messages):
    """Why the prompt `messages` (the llm() call whose reply named `move`) leads the model to
    `move`, or None. The parent fixes two orders of the legal moves: P, sorted UCI (legal_moves()),
    and C, forcing first (checks, then captures, then the rest, each in P's order: what
    legal_moves_san() marks). A prompt that names `move` leads when
    (1) the moves its system and user turns name are not a list the parent fixes: the first k of
        P or of C, k >= min(8, moves) (all of them, or a short list forcing moves first; not the
        checks alone: in a mate puzzle the only check is often the answer);
    (2) it names `move` more often than most moves it names (a hint, an echo). A complaint after a
        model turn (a retry) may name all moves again, or moves sharing a square with a move that
        turn wrote (its piece's other moves): those are not counted; any other move it names is;
    (3) it names `move` before a move that precedes it in both P and C (the solution put first).
    What it cannot see: prose that points at a move without naming it ("the queen can reach the
    king"), a hint in a model turn the harness wrote in the model's name, an example move of the
    prompt's own text that happens to be legal (counted as a hint: the model may copy it), and a
    harness that picks which fair list to show from a move generator of its own."""
    turns = [(m["role"], m["content"]) for m in messages]
    shown = [c for r, c in turns if r != "assistant"]
    named = mentions(shown, board)
    uci = move.uci()
    if uci not in named:
        return None
    sans = _sans(board.fen())
    P = sorted(sans)
    checks = [u for u in P if sans[u][-1] in "+#"]
    captures = [u for u in P if "x" in sans[u] and u not in checks]
    C = checks + captures + [u for u in P if u not in checks and u not in captures]
    S, k = set(named), min(8, len(P))
    if not any(S == set(order[:n]) for order in (P, C) for n in range(k, len(P) + 1)):
        return f"the prompt names {len(S)} of the {len(P)} legal moves, {uci} among them, not a list the parent fixes"
    first = next((i for i, (r, _) in enumerate(turns) if r == "assistant"), len(turns))
    counts = {u: c for u, (c, _) in mentions([c for r, c in turns[:first] if r != "assistant"], board).items()}
    model_said = ""
    for role, text in turns[first:]:
        if role == "assistant":
            model_said = " ".join(re.findall(r"[a-h][1-8][-x ]?[a-h][1-8]", text.lower()))
            continue
        later = mentions([text], board)
        if set(later) == set(P):
            continue  # the whole list again
        for u, (c, _) in later.items():
            if u[:2] not in model_said and u[2:4] not in model_said:
                counts[u] = counts.get(u, 0) + c
    usual = sorted(counts.values())[len(counts) // 2] if counts else 0
    if counts.get(uci, 0) > max(usual, 1):
        return f"the prompt names {uci} {counts[uci]} times, most moves it names {usual}"
    ahead = [u for u in S if P.index(u) < P.index(uci) and C.index(u) < C.index(uci) and named[u][1] > named[uci][1]]
    if ahead:
        return f"the prompt names {uci} before {ahead[0]}, which the parent's orders put first"
    return None


def verify(example, answer, state):
    """1.0 iff the rollout's board reached the solution's mate; the answer itself is ignored."""
    return 1.0 if getattr(state, "solved", False) is True else 0.0


# ---------------------------------------------------------------- harness search space

PROMPT_AXES = {"SYSTEM_PROMPT", "USER_TEMPLATE"}

PRIMITIVES = {
    "SYSTEM_PROMPT": [
        'SYSTEM_PROMPT = ("You are a chess puzzle solver. In every puzzle the side to move can force checkmate. '
        'Look for checks first, then captures. Answer with exactly one move in UCI notation, e.g. <move>e2e4</move>.")',

        'SYSTEM_PROMPT = ("You are a strong chess player. Think briefly about which enemy king squares are '
        'covered, then give your move as <move>from-square to-square</move> in UCI, like <move>g1f3</move>.")',
    ],
    "USER_TEMPLATE": [
        'USER_TEMPLATE = ("{observation}\\n\\n{side} to move and checkmate in {mate_in}. '
        'Which move starts the mate? Reply with <move>uci</move>.")',

        'USER_TEMPLATE = ("Puzzle: {side} mates in {mate_in}.\\n{observation}\\n\\n'
        'Pick ONE move from the legal moves above and write it as <move>uci</move>, for example <move>d1h5</move>.")',

        'USER_TEMPLATE = ("{side} to move can checkmate in {mate_in}.\\n{observation}\\n\\n'
        'Which move mates (or starts the mate)? Copy that one line\'s move as <move>uci</move>.")',
    ],
    "format_observation": [
        '''def format_observation(task, fen, board, moves, last):
    """Board with file letters and rank numbers, so squares can be read off directly."""
    rows = [f"{8 - i} {row}" for i, row in enumerate(board.splitlines())]
    text = "\\n".join(rows) + "\\n  a b c d e f g h\\n"
    if last:
        text += f"The opponent just played {last}.\\n"
    return text + f"{task['side'].capitalize()} to move.\\nLegal moves: {moves}"
''',
        '''def format_observation(task, fen, board, moves, last):
    """Compact: FEN and legal moves only (a short prompt for a small model)."""
    note = f"Opponent's last move: {last}\\n" if last else ""
    return f"FEN: {fen}\\n{note}{task['side'].capitalize()} to move.\\nLegal moves: {moves}"
''',
        '''def format_observation(task, fen, board, moves, last):
    """List the pieces of each side (read from the FEN) instead of drawing the board."""
    names = {"k": "King", "q": "Queen", "r": "Rook", "b": "Bishop", "n": "Knight", "p": "Pawn"}
    pieces = {"White": [], "Black": []}
    for r, row in enumerate(fen.split()[0].split("/")):
        f = 0
        for ch in row:
            if ch.isdigit():
                f += int(ch)
                continue
            square = "abcdefgh"[f] + str(8 - r)
            pieces["White" if ch.isupper() else "Black"].append(f"{names[ch.lower()]} {square}")
            f += 1
    text = "\\n".join(f"{side}: " + ", ".join(ps) for side, ps in pieces.items())
    if last:
        text += f"\\nThe opponent just played {last}."
    return text + f"\\n{task['side'].capitalize()} to move.\\nLegal moves: {moves}"
''',
        '''def format_observation(task, fen, board, moves, last):
    """Short: no FEN and no board (harness-split replies never read a square off either; they copy
    moves from the list), only whose move it is, the opponent's last move and the moves."""
    note = f"The opponent just played {last}.\\n" if last else ""
    return f"{note}{task['side'].capitalize()} to move. The moves:\\n{moves}"
''',
    ],
    "annotate_moves": [
        '''def annotate_moves(legal, tools):
    """Each UCI move with its SAN, which names the piece and marks captures (x) and checks (+)."""
    return ", ".join(f"{u} ({s})" for u, s in zip(legal, tools.legal_moves_san()))
''',
        '''def annotate_moves(legal, tools):
    """Forcing moves first: checks, then captures, then the rest (all still the model's choice)."""
    pairs = list(zip(legal, tools.legal_moves_san()))
    checks = [u for u, s in pairs if s.endswith("+")]
    captures = [u for u, s in pairs if "x" in s and not s.endswith("+")]
    quiet = [u for u, s in pairs if u not in checks and u not in captures]
    return (f"checks: {' '.join(checks) or '-'}; captures: {' '.join(captures) or '-'}; "
            f"other: {' '.join(quiet) or '-'}")
''',
        '''def annotate_moves(legal, tools):
    """Moves grouped by the piece that moves, e.g. 'Queen d1: d1d2 d1h5'."""
    fen = tools.fen().split()[0]
    board = {}
    for r, row in enumerate(fen.split("/")):
        f = 0
        for ch in row:
            if ch.isdigit():
                f += int(ch)
            else:
                board["abcdefgh"[f] + str(8 - r)] = ch
                f += 1
    names = {"k": "King", "q": "Queen", "r": "Rook", "b": "Bishop", "n": "Knight", "p": "Pawn"}
    groups = {}
    for u in legal:
        groups.setdefault(u[:2], []).append(u)
    return "; ".join(f"{names[board[sq].lower()]} {sq}: {' '.join(us)}" for sq, us in groups.items())
''',
        '''def annotate_moves(legal, tools):
    """A short candidate list, forcing moves first: every check, then captures, then the rest, at least
    8 moves where there are 8 (never one), a line each: the move as <move>uci</move>, its SAN and what
    it does ("queen h5 to h7, takes the pawn, check"). Harness-split replies copy the first moves of a
    list; they copied a7a5 from a list sorted a..h. The model still names the move it plays."""
    names = {"k": "king", "q": "queen", "r": "rook", "b": "bishop", "n": "knight", "p": "pawn"}
    at = {}
    for r, row in enumerate(tools.fen().split()[0].split("/")):
        f = 0
        for ch in row:
            if ch.isdigit():
                f += int(ch)
            else:
                at["abcdefgh"[f] + str(8 - r)] = names[ch.lower()]
                f += 1
    pairs = list(zip(legal, tools.legal_moves_san()))
    checks = [p for p in pairs if p[1].endswith("+")]
    captures = [p for p in pairs if "x" in p[1] and p not in checks]
    rest = [p for p in pairs if p not in checks and p not in captures]
    lines = []
    for u, s in (checks + captures + rest)[:max(8, len(checks))]:
        what = f"{at[u[:2]]} {u[:2]} to {u[2:4]}"
        if "x" in s:
            what += f", takes the {at.get(u[2:4], 'pawn')}"
        if "=" in s:
            what += ", promotes"
        if s.endswith("+"):
            what += ", check"
        lines.append(f"<move>{u}</move> {s}: {what}")
    return "\\n".join(lines)
''',
    ],
    "parse_move": [
        '''def parse_move(text, legal, tools):
    """Lenient: the tag is optional, case and separators ('e2-e4', 'e2 e4') are forgiven; the first
    move inside <move> wins, else the last UCI-looking token of the reply."""
    clean = re.sub(r"([a-h][1-8])\\s*[-x ]\\s*([a-h][1-8])", r"\\1\\2", text.lower())
    tagged = re.search(r"<move>\\s*([a-h][1-8][a-h][1-8][qrbn]?)", clean)
    if tagged:
        return tagged.group(1)
    found = re.findall(r"\\b([a-h][1-8][a-h][1-8][qrbn]?)\\b", clean)
    return found[-1] if found else None
''',
        '''def parse_move(text, legal, tools):
    """UCI, or else SAN ('Qh5', 'Nxe5', 'exd5', 'O-O', 'e8=Q+') looked up in tools.legal_moves_san()."""
    m = re.search(r"<move>\\s*([a-h][1-8][a-h][1-8][qrbn]?)", text.lower()) or \\
        re.search(r"\\b([a-h][1-8][a-h][1-8][qrbn]?)\\b", text.lower())
    if m:
        return m.group(1)
    tag = re.search(r"<move>\\s*([^<\\s]+)", text)
    words = [tag.group(1)] if tag else text.split()
    table = {s.rstrip("+#"): u for u, s in zip(legal, tools.legal_moves_san())}
    for word in reversed(words):  # the last SAN-looking word is the model's conclusion
        san = word.strip(".,!?:;()").rstrip("+#")
        san = san.replace("0", "O") if set(san) <= set("0-") else san  # 0-0 for O-O
        if san in table:
            return table[san]
    return None
''',
        '''def parse_move(text, legal, tools):
    """Move-format recovery: UCI with or without separators; a promotion written without its
    piece (e7e8 -> e7e8q); SAN. Never a guess: no match, no move."""
    low = re.sub(r"([a-h][1-8])\\s*[-x ]\\s*([a-h][1-8])", r"\\1\\2", text.lower())
    tag = re.search(r"<move>\\s*([^<\\n]*)", low)
    scope = tag.group(1) if tag else low
    for u in re.findall(r"\\b([a-h][1-8][a-h][1-8][qrbn]?)\\b", scope)[::-1]:
        if u in legal:
            return u
        if u + "q" in legal:
            return u + "q"
    san = {s.rstrip("+#"): u for u, s in zip(legal, tools.legal_moves_san())}
    words = (re.search(r"<move>\\s*([^<\\n]*)", text) or re.search(r"(.*)", text, re.S)).group(1)
    for word in reversed(words.replace("0-0", "O-O").split()):
        w = word.strip(".,!?:;()<>/").rstrip("+#")
        if w in san:
            return san[w]
    return None
''',
        '''def parse_move(text, legal, tools):
    """The FIRST legal move the reply names, in reading order, as UCI (e2e4, e2-e4) or SAN (Qxh7):
    harness-split replies list several moves copied from the prompt, the meant one first."""
    low, found = text.lower(), []
    for u, s in zip(legal, tools.legal_moves_san()):
        hits = [m.start() for m in (
            re.search(r"(?<![a-z0-9])" + u[:2] + r"[-x ]?" + u[2:] + r"(?![a-z0-9])", low),
            re.search(r"(?<![A-Za-z0-9])" + re.escape(s.rstrip("+")) + r"(?![A-Za-z0-9])", text)) if m]
        if hits:
            found.append((min(hits), u))
    return min(found)[1] if found else None
'''
    ],
    "format_retry": [
        '''def format_retry(move, legal):
    """Say what was wrong, and show the legal moves again."""
    if move is None:
        return "I could not find a move in your reply. Write exactly one move like <move>e2e4</move>."
    return f"{move} is not a legal move here. Choose one of: {' '.join(legal)}. Reply with <move>uci</move>."
''',
        '''def format_retry(move, legal):
    """Short and strict, with the exact format repeated."""
    problem = "no move found" if move is None else f"illegal move {move}"
    return f"Error: {problem}. Answer with only <move>XXXX</move> where XXXX is one of the legal moves."
''',
        '''def format_retry(move, legal):
    """Move-format recovery by example: an illegal move gets the legal moves of the same piece
    (same from-square) or onto the same square, a missing move a reminder of the exact form."""
    if move is None:
        return ("No move found. Reply with exactly one legal move, copied from the list, like "
                f"<move>{legal[0]}</move>.")
    near = [u for u in legal if u[:2] == move[:2] or u[2:4] == move[2:4]]
    return (f"{move} is not legal here. " + (f"Legal moves of that piece or to that square: {' '.join(near)}. "
            if near else "") + "Reply with one move from the legal list inside <move></move>.")
''',
    ],
    "MAX_RETRIES": ["MAX_RETRIES = 0", "MAX_RETRIES = 3"],
    "MAX_TURNS": ["MAX_TURNS = 2", "MAX_TURNS = 8"],
}

SKILL = """\
Domain: chess puzzles. Each task is {"fen": str, "plies": 1 or 3, "side": "white" or "black"}: the side to
move can force checkmate in 1 move (plies 1) or in 2 moves (plies 3: our move, the opponent's reply, mate).
The environment runs outside the harness and plays the opponent. Tools (results are plain strings/lists):
  tools.fen() -> FEN; tools.board() -> ASCII board (rank 8 on top, White upper case, '.' empty)
  tools.legal_moves() -> sorted UCI moves; tools.legal_moves_san() -> the same moves in SAN, same order
                         (checks '+', captures 'x'; a mating move is also shown with '+', never '#')
  tools.play(uci) -> "ok: the opponent replied <uci>" | "solved: ..." | "over: ..."
A non-UCI argument, or a move the model's LATEST reply does not name (as UCI or SAN), raises a tool error
(nothing is played, you may retry). An illegal move or a wrong legal move ENDS the puzzle ("over: ..."), so
check the model's move against legal_moves() BEFORE calling play.
The score is 1 iff the puzzle was solved; run()'s return value is ignored.

The seed harness h0 (domains/chess_h0.py) is weak on purpose. Its axes, each ONE top-level name:
  SYSTEM_PROMPT (str, "" = none), USER_TEMPLATE (str; .format(observation=, side=, mate_in=))
  format_observation(task, fen, board, moves, last) -> str   (what the model sees; last = opponent's reply)
  annotate_moves(legal, tools) -> str                        (how the legal moves are listed)
  parse_move(text, legal, tools) -> uci or None              (reading the model's reply)
  format_retry(move, legal) -> str                           (feedback after no move / an illegal move)
  MAX_RETRIES (model retries per move), MAX_TURNS (model calls per puzzle)
Rules: the MODEL chooses every move. The harness may format, annotate, parse and retry, but it must never
pick, filter down to one, or compute a move itself (no move generators, no mate search, no "play the only
check"); importing python-chess or any non-standard module is forbidden. One mechanism per candidate; only the
standard library; never hard-code positions, moves or dataset names; the test split is never shown to you.
"""
