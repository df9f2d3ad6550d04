"""Math domain: integer word problems and expressions, a Python tool, a boxed-number verifier.

Data (data/math/, built by data/build_math.py from reasoning-gym==0.1.25): every
split is half "hard" (gsm_symbolic: GSM8K-style word problems) and half "easy"
(basic_arithmetic: short integer expressions). The task holds {"problem"}; the
private answer holds {"value": "<integer>", "tier": "hard"|"easy"}.

Tool: python(code) runs model-written code in a nested sandbox (sandbox.run_python,
its own process with time and memory limits) and returns stdout, followed by the
last line of the error if there was one, cut to ~2000 characters.

Verifier: the number in the last \\boxed{...} of the answer, or the answer itself
when the harness returned a bare number ("42", "$1,200", "15 apples"), must equal
the reference within 1e-6. This is plain parsing rather than a symbolic checker
such as math-verify: every reference answer is an integer, so all that has to be
forgiven is notation (thousands commas, $, \\text{units}, \\frac, x = ...), and a
small parser is easier to audit than a sympy dependency. Anything else (no box,
prose around a bare number, None, junk) scores 0.0 and never raises.

What it leaves out: AIME-style competition problems (out of reach of the 135M
default model), symbolic answers, partial credit.
"""
import gzip
import json
import os
import re
from fractions import Fraction
from pathlib import Path

from domains import check_records

NAME = "math"
# $WHALE_DATA points at another data root holding math/; default: the repo's data/
DATA = Path(os.environ.get("WHALE_DATA") or Path(__file__).resolve().parent.parent / "data") / "math"
SPLITS = ("weight", "harness", "val", "test")
H0 = str(Path(__file__).resolve().with_name("math_h0.py"))
TOOL_OUTPUT_CHARS = 2000


def load_split(split):
    """weight 2000, harness 128, val 100, test 250 examples; half hard, half easy."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    with gzip.open(DATA / f"{split}.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    return check_records(records, DATA / f"{split}.jsonl.gz", ("problem",), ("value",))


# ---------------------------------------------------------------- tools

def python(code):
    """Run `code` in a fresh sandboxed interpreter; return what it printed (+ the error's last line)."""
    from jail import sandbox  # imported here: the domain module must load without the sandbox machinery
    if not isinstance(code, str):
        return "Error: code must be a string"
    result = sandbox.run_python(code, timeout_s=5.0, mem_mb=512, max_output=4000)
    out = result.get("stdout") or ""
    if len(out) > TOOL_OUTPUT_CHARS:
        out = out[:TOOL_OUTPUT_CHARS] + "\n...[output truncated]"
    if result.get("error"):
        # the last line of a traceback names the exception: the part a model can act on
        lines = [ln for ln in str(result["error"]).strip().splitlines() if ln.strip()]
        out = (out.rstrip("\n") + "\n" if out.strip() else "") + (lines[-1][:300] if lines else "Error")
    return out


def make_tools(example):
    """The same stateless tool for every problem; verify needs no state."""
    return {"python": python}, None


# ---------------------------------------------------------------- verifier

_BARE = re.compile(
    r"(?:[a-zA-Z]\w*\s*=\s*)?"            # "x = 5"
    r"\(?\s*(?P<num>[-+]?(?:\d+\.?\d*|\.\d+))\s*"
    r"(?:/\s*(?P<den>[-+]?\d+\.?\d*)\s*)?\)?\s*"   # "3/4"
    r"(?:[a-zA-Z]+(?: [a-zA-Z]+)?)?\.?")  # one or two unit words: "15 apples", "12 square feet"


def boxed_content(text):
    """Content of the last \\boxed{...} (nested braces allowed), or None."""
    end = len(text)
    for _ in range(5):  # a truncated last box may hide a complete one before it
        start = text.rfind("\\boxed", 0, end)
        if start < 0:
            return None
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, min(len(text), i + 1000)):  # no number is longer than this
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j]
        end = start
    return None


def parse_number(s):
    """A number written the way models write answers -> Fraction, or None."""
    if len(s) > 200:
        return None
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r" \1 ", s)
    s = re.sub(r"\^\{?\\circ\}?|\\[,!;: ]|\\?[$%]|\\left|\\right", " ", s)
    s = s.replace("\u2212", "-").replace("{", "").replace("}", "")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators only: "1,234"
    s = re.sub(r"\((-?[\d.]+)\)", r"\1", s).strip()
    m = _BARE.fullmatch(s)
    if not m:
        return None
    try:
        value = Fraction(m["num"])
        return value / Fraction(m["den"]) if m["den"] else value
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(answer):
    """The last boxed number of a reply, or the reply itself if it is a bare number."""
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return None
    text = str(answer)
    inside = boxed_content(text)
    return parse_number(inside if inside is not None else text.strip())


def verify(example, answer, state=None):
    """1.0 iff the answer's number equals the reference value within 1e-6, else 0.0."""
    try:
        got = extract_answer(answer)
        gold = Fraction(example["answer"]["value"])
        return 1.0 if got is not None and abs(got - gold) <= Fraction(1, 10**6) else 0.0
    except Exception:  # junk must cost the rollout, never the run
        return 0.0


# ---------------------------------------------------------------- harness search space

PROMPT_AXES = {"SYSTEM_PROMPT", "USER_TEMPLATE"}

PRIMITIVES = {
    "SYSTEM_PROMPT": [
        'SYSTEM_PROMPT = "You are a careful math tutor. Solve the problem step by step, one short '
        'calculation per line, then write the final answer as \\\\boxed{number}."',

        'SYSTEM_PROMPT = "You can run Python. To calculate, write one ```python code block that '
        'prints the answer. After you see its output, reply with the final answer as \\\\boxed{number}."',

        'SYSTEM_PROMPT = "Answer math questions. The final answer is a single whole number. '
        'Always end your reply with \\\\boxed{number}."',
    ],
    "USER_TEMPLATE": [
        'USER_TEMPLATE = "{problem}\\nThink step by step. End with the final answer as \\\\boxed{{number}}."',

        'USER_TEMPLATE = "Problem: {problem}\\n\\nWrite a short Python program that computes the answer '
        'and prints it, in one ```python code block."',

        'USER_TEMPLATE = "Question: {problem}\\nFirst write down the numbers in the question, then '
        'compute the answer. Finish with: The answer is \\\\boxed{{number}}."',

        # code-first with the program's skeleton already written: a small model fills in numbers far
        # more reliably than it starts a program, and the last line prints what the harness reads
        'USER_TEMPLATE = "{problem}\\n\\nComplete this program and send it in one ```python block:\\n'
        '```python\\n# the numbers from the problem\\n...\\n# the calculation\\nanswer = ...\\nprint(answer)\\n```"',
    ],
    "normalize_code": [
        '''def normalize_code(text):
    """Last fenced block of any language; print the last line if it is a bare expression."""
    import ast
    blocks = re.findall(r"```[a-zA-Z]*\\n(.*?)```", text, re.S)
    if not blocks:
        return None
    code = blocks[-1].strip()
    lines = code.splitlines()
    try:
        last = ast.parse(lines[-1].strip())
        if len(last.body) == 1 and isinstance(last.body[0], ast.Expr) and "print(" not in lines[-1]:
            lines[-1] = "print(" + lines[-1].strip() + ")"
    except (SyntaxError, IndexError):
        pass
    return "\\n".join(lines)
''',
        '''def normalize_code(text):
    """Fenced code, or else the bare "name = ..." lines; print the last expression or assigned name."""
    import ast
    blocks = re.findall(r"```(?:python|py)?\\s*\\n(.*?)```", text, re.S)
    if blocks:
        code = "\\n".join(blocks)
    else:  # small models often write bare statements like "total = 3 * 4"
        lines = [ln for ln in text.splitlines() if re.match(r"\\s*[A-Za-z_]\\w*\\s*=[^=]|\\s*print\\(", ln)]
        code = "\\n".join(ln.strip() for ln in lines)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code or None
    if not tree.body:
        return None
    last = tree.body[-1]
    if isinstance(last, ast.Expr) and "print(" not in ast.unparse(last):
        code += "\\nprint(" + ast.unparse(last) + ")"
    elif isinstance(last, ast.Assign) and "print(" not in code:
        code += "\\nprint(" + ast.unparse(last.targets[0]) + ")"
    return code
''',
    ],
    "format_feedback": [
        '''def format_feedback(output):
    """Output plus a nudge to finish with a boxed answer."""
    return ("The code printed:\\n" + output.strip() + "\\n\\nUsing this result, "
            "write the final answer as \\\\boxed{number}.")
''',
        '''def format_feedback(output):
    """Different nudges for an error, an empty output and a good run."""
    out = output.strip()
    if not out:
        return "Your code printed nothing. Add print(...) for the answer and send the code again."
    if "Error" in out.splitlines()[-1]:
        return "Your code failed:\\n" + out + "\\nFix the mistake and send the corrected ```python code."
    return "Output: " + out + "\\nThe final answer is this number. Reply with \\\\boxed{" + out.splitlines()[-1] + "}."
''',
        '''def format_feedback(output):
    """Code-first repair: an error gets the error and the skeleton to fill in again; a printed
    number is handed back as the answer to box."""
    out = output.strip()
    if not out or "Error" in out.splitlines()[-1]:
        return ("Your program did not print an answer" + (":\\n" + out if out else ".") +
                "\\nSend the whole program again, ending with print(answer), in one ```python block.")
    return "The program printed: " + out.splitlines()[-1] + "\\nWrite the final answer as \\\\boxed{number}."
''',
    ],
    "recover_answer": [
        '''def recover_answer(text, output):
    """Without a box, take the last number in the reply."""
    if "\\\\boxed" in text:
        return text
    numbers = re.findall(r"-?\\d[\\d,]*(?:\\.\\d+)?", text)
    return numbers[-1].replace(",", "") if numbers else None
''',
        '''def recover_answer(text, output):
    """Without a box, trust the code's last printed number, then the reply's last number."""
    if "\\\\boxed" in text:
        return text
    for source in (output or "", text):
        numbers = re.findall(r"-?\\d[\\d,]*(?:\\.\\d+)?", source)
        if numbers:
            return numbers[-1].replace(",", "")
    return None
''',
        '''def recover_answer(text, output):
    """Answer recovery in order of trust: a box holding a number (units and words inside the
    box dropped: \\\\boxed{x = 12 apples} -> 12), the code's last printed number when the code
    ran cleanly, "answer is N" in the reply, then the reply's last number."""
    number = r"-?\\d[\\d,]*(?:\\.\\d+)?"
    boxed = re.findall(r"\\\\boxed\\{([^{}]*)\\}", text)
    if boxed:
        found = re.findall(number, boxed[-1])
        return found[-1].replace(",", "") if found else text
    if output and "Error" not in output:
        found = re.findall(number, output)
        if found:
            return found[-1].replace(",", "")
    said = re.findall(r"answer is\\D{0,20}(" + number + ")", text, re.IGNORECASE)
    found = said or re.findall(number, text)
    return found[-1].replace(",", "") if found else None
''',
    ],
    "MAX_TURNS": [
        "MAX_TURNS = 1",
        "MAX_TURNS = 3",
        "MAX_TURNS = 4",
    ],
}

SKILL = """\
Domain: math. Each task is {"problem": str}: a grade-school word problem (GSM8K templates) or a
short integer expression. The reference answer is always an integer. The verifier reads the LAST
\\boxed{...} in the string run() returns, or the whole string if it is a bare number ("42", "$1,200",
"15 apples"); anything else scores 0.

Tool: tools.python(code: str) -> str runs the code in a fresh Python process (5 s, 512 MB, no network)
and returns what it printed plus the last line of any error, cut to ~2000 characters. Code that
prints nothing returns "". A tool failure raises an exception inside the harness.

The seed harness h0 (domains/math_h0.py) is weak on purpose. Its axes, each ONE top-level name:
  SYSTEM_PROMPT (str, "" = none), USER_TEMPLATE (str, .format(problem=...), braces doubled)
  normalize_code(text) -> code str or None   (which code to run, fences, adding print)
  format_feedback(output) -> str             (the user message after a code run; retry nudges)
  recover_answer(text, output) -> str|None   (the answer when the model forgot \\boxed{})
  MAX_TURNS (int: model calls per problem)
The model is small (SmolLM2-135M-Instruct): short, concrete instructions and a harness that does
the bookkeeping (running code, printing results, extracting numbers) help more than long prompts.

Rules: one mechanism per candidate; only the standard library (top-level import is `re`; import
anything else inside your function); never hard-code answers, problem texts or dataset names;
do not compute the answer in harness code (the model must produce it, by text or by code it writes);
the test split is never shown to you.
"""
