"""h0 with four menu alternatives stacked by results/three-domains/chess_stack.py: annotate_moves 4/4, parse_move 4/4, format_observation 4/4, USER_TEMPLATE 3/3

Seed harness h0 for chess puzzles: deliberately weak, like the paper's.

For each of our moves the model gets a fresh prompt: the FEN, the ASCII board and the legal moves as a plain
UCI list, and is asked for the best move inside <move></move> (it is not even told that a mate exists). If
the reply holds no move, or a move that is not in the legal list, the model gets MAX_RETRIES more tries with a
terse complaint; then the move goes to tools.play, where a legal but wrong move ends the puzzle. After a correct
move the environment answers for the opponent and the loop goes on until the puzzle is solved or lost, or the
model has been called MAX_TURNS times. The harness never picks a move itself: if the model gives no legal move,
it gives up. Its return value (the moves played) is ignored by the verifier, which reads the board.

The axes, each one top-level name that a search may replace:
  SYSTEM_PROMPT, USER_TEMPLATE      prompt text; the template gets .format(observation=, side=, mate_in=)
  format_observation(task, fen, board, moves, last)   what the model sees (last = opponent's reply or None)
  annotate_moves(legal, tools)      how the legal moves are listed (tools.legal_moves_san() can add SAN)
  parse_move(text, legal, tools)    the model's reply -> a UCI string or None
  format_retry(move, legal)         the complaint after no move (move None) or an illegal one
  MAX_RETRIES                       extra model calls per move after a format / illegal-move problem
  MAX_TURNS                         model calls per puzzle
Standard library only (`re` is imported here). Contract: run(task, llm, tools) -> str | None.
"""
import re

SYSTEM_PROMPT = "You are a chess player."

USER_TEMPLATE = ("{side} to move can checkmate in {mate_in}.\n{observation}\n\nWhich move mates (or starts the mate)? Copy that one line's move as <move>uci</move>.")

MAX_RETRIES = 1

MAX_TURNS = 4

MAX_TOKENS = 64  # per model call; the answer is one short tag


def format_observation(task, fen, board, moves, last):
    """Short: no FEN and no board (harness-split replies never read a square off either; they copy
    moves from the list), only whose move it is, the opponent's last move and the moves."""
    note = f"The opponent just played {last}.\n" if last else ""
    return f"{note}{task['side'].capitalize()} to move. The moves:\n{moves}"


def annotate_moves(legal, tools):
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
    return "\n".join(lines)


def parse_move(text, legal, tools):
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


def format_retry(move, legal):
    """The same complaint for every problem."""
    return "Invalid move. Answer with <move>uci</move>."


def run(task, llm, tools):
    played, last, calls = [], None, 0
    while calls < MAX_TURNS:
        legal = tools.legal_moves()
        observation = format_observation(task, tools.fen(), tools.board(), annotate_moves(legal, tools), last)
        prompt = USER_TEMPLATE.format(observation=observation, side=task["side"].capitalize(),
                                      mate_in=(task["plies"] + 1) // 2)
        messages = ([{"role": "system", "content": SYSTEM_PROMPT}] if SYSTEM_PROMPT else []) + \
                   [{"role": "user", "content": prompt}]
        move = None
        for _ in range(MAX_RETRIES + 1):
            if calls >= MAX_TURNS:
                break
            reply = llm(messages, max_tokens=MAX_TOKENS, stop=["</move>"])
            calls += 1
            move = parse_move(reply, legal, tools)
            if move in legal:
                break
            # catch format and illegal-move problems here: an illegal move sent to play() loses the puzzle
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": format_retry(move, legal)}]
        if move not in legal:
            break  # no legal move from the model: give up rather than choose one for it
        result = tools.play(move)
        played.append(move)
        if not result.startswith("ok"):
            break  # "solved: ..." or "over: ..."
        last = result.split()[-1]  # "ok: the opponent replied e7e5"
    return " ".join(played) or None
