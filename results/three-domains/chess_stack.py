"""What the chess menu reaches when its four trace-written primitives are stacked at once, without a
search: the measurement beside the three failed gates (README.md, stage 3's negative). Not a gate and
not a candidate of any run: the harness is built by code from the menu (domains/chess.py PRIMITIVES),
so anyone can rebuild it, and it is scored exactly as chess_gate.py scores a gate's harness.

    python results/three-domains/chess_stack.py [--limit 100] [--n 4] [--out results/three-domains/chess-stack.json]
    python results/three-domains/chess_stack.py --list-only    # only what a pick from its move list would score

The stack is the four alternatives stage 3 wrote from h0's harness-split traces, each one axis:
annotate_moves 4/4 (a short candidate list, forcing moves first), parse_move 4/4 (the first legal
move the reply names), format_observation 4/4 (no FEN, no board) and USER_TEMPLATE 3/3 (says a mate
exists). To read the built harness: `python -c "import sys; sys.path[:0] = ['.', 'results/three-domains'];
import chess_stack; print(chess_stack.stacked_harness())"`.
Beside the model's score it gives what the harness's candidate list alone would give, no model: on how
many puzzles the list holds the mating move, on how many it is the first line, and the expected
success of a uniform pick among the listed moves (`list_baselines`)."""
import argparse
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # chess_gate beside this file
import whale  # noqa: E402 (first: the process settings a run has)
from chess_gate import gate  # noqa: E402
from domains import chess  # noqa: E402
from harness_search.harness_source import splice, with_hypothesis  # noqa: E402
from lm import engine  # noqa: E402

STACK = [("annotate_moves", 4), ("parse_move", 4), ("format_observation", 4), ("USER_TEMPLATE", 3)]  # 1-based


def stacked_harness() -> str:
    source = Path(chess.H0).read_text()
    for axis, k in STACK:
        source = splice(source, axis, chess.PRIMITIVES[axis][k - 1])
    said = ", ".join(f"{axis} {k}/{len(chess.PRIMITIVES[axis])}" for axis, k in STACK)
    return with_hypothesis(source, f"h0 with four menu alternatives stacked by results/three-domains/chess_stack.py: {said}")


def list_baselines(source: str, puzzles: list) -> dict:
    """What the harness's annotate_moves list alone scores on mate-in-1 puzzles (no model): the
    puzzles whose list holds the mating move, those where it is the first line, and the expected
    success of picking one listed move uniformly at random."""
    mod = {}
    exec(compile(source, "chess-stack-harness.py", "exec"), mod)  # (our own menu's code, built above)
    listed = first = 0
    uniform = 0.0
    ones = [p for p in puzzles if p["task"]["plies"] == 1]
    for p in ones:
        tools = types.SimpleNamespace(**chess.make_tools(p)[0])
        lines = mod["annotate_moves"](tools.legal_moves(), tools).split("\n")
        at = [i for i, line in enumerate(lines) if line.startswith(f"<move>{p['answer']['line'][0]}</move>")]
        listed, first, uniform = listed + bool(at), first + (at[:1] == [0]), uniform + (1 / len(lines) if at else 0)
    return {"mate_in_1_puzzles": len(ones), "mate_listed": listed, "mate_first": first,
            "uniform_pick": uniform / max(1, len(ones))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=100, help="the first N weight-pool puzzles")
    ap.add_argument("--n", type=int, default=4, help="samples per puzzle")
    ap.add_argument("--out", default="results/three-domains/chess-stack.json", help="where the JSON goes")
    ap.add_argument("--list-only", action="store_true", help="only the list's baselines, no model (seconds); "
                    "merged into --out when it scored this same harness")
    a = ap.parse_args()
    if a.limit < 1 or a.n < 1:
        sys.exit("chess_stack.py: --limit and --n must be >= 1")
    source, puzzles = stacked_harness(), chess.load_split("weight")[:a.limit]
    out = Path(a.out)
    lists = list_baselines(source, puzzles)
    print(f"the list alone, weight[:{a.limit}]'s {lists['mate_in_1_puzzles']} mate-in-1 puzzles: the mate listed in "
          f"{lists['mate_listed']}, first in {lists['mate_first']}; a uniform pick among the listed moves "
          f"{lists['uniform_pick']:.4f}", flush=True)
    stack = [f"{axis} {k}" for axis, k in STACK]
    if a.list_only:  # merged into a JSON whose model score is of this same stack and these puzzles
        old = json.loads(out.read_text()) if out.is_file() else {}
        if old.get("stack") == stack and old.get("puzzles") == a.limit:
            out.write_text(json.dumps({**old, "list": lists}, indent=1) + "\n")
        return
    args = whale.Args(domain="chess")
    r = gate(source, engine.load_engine(args.model), puzzles, a.n, args)
    r.update(stack=stack, list=lists)
    print(f"stacked: weight[:{a.limit}] mean@{a.n} {r['mean']:.4f} +- {r['se']:.4f}  mate in 1 {r['mate_in_1']:.3f}  "
          f"mate in 2 {r['mate_in_2']:.3f}  puzzles with a success {r['puzzles_with_a_success']}  "
          f"turns {r['mean_turns']:.2f}  errors {r['errors']}  {r['seconds']:.0f} s", flush=True)
    out.write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
