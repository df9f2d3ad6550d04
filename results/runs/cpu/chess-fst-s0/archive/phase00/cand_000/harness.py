"""Seed harness h0 for chess puzzles: deliberately weak, like the paper's.

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

USER_TEMPLATE = "{observation}\n\nWhat is the best move? Answer with the move in UCI notation inside <move></move>."

MAX_RETRIES = 1

MAX_TURNS = 4

MAX_TOKENS = 64  # per model call; the answer is one short tag


def format_observation(task, fen, board, moves, last):
    """FEN, the raw ASCII board, whose turn it is and the legal moves."""
    text = f"FEN: {fen}\nBoard:\n{board}\n"
    if last:
        text += f"The opponent played {last}.\n"
    return text + f"{task['side'].capitalize()} to move.\nLegal moves: {moves}"


def annotate_moves(legal, tools):
    """No annotation: the bare UCI list."""
    return " ".join(legal)


def parse_move(text, legal, tools):
    """The UCI move right after <move> (the closing tag is the stop string, so it is often missing)."""
    m = re.search(r"<move>\s*([a-h][1-8][a-h][1-8][qrbn]?)", text)
    return m.group(1) if m else None


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
