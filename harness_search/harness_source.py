"""harness_source.py: a harness file as Python source: what is in it, how to edit one definition,
when two files are the same program.

    top_level_names(source) -> {name: (first_line, last_line)}   # the axes a search may replace
    splice(source, name, new_definition) -> source                # one definition swapped, the rest byte-identical
    normalized(source) -> str                                     # equal for the same program
    differs_only_in(base, candidate, names) -> (ok, why)          # FST's prompt-only rule
    static_check(source) -> reason or None                        # can this be a harness at all?
    parse(source) -> ast.Module                                   # ast.parse, bounded (SyntaxError otherwise)
    docstring(source), hypothesis(source) -> str or None          # its docstring, and that's first line
    with_hypothesis(source, line) -> source                       # that line put first, the code untouched

Everything works on the source text with `ast`; nothing here runs harness code (sandbox.py
does). Every parse goes through parse(), which turns a source too deep or too large to parse
(a 90,000-link attribute chain, 100,000 unary minus signs) into a SyntaxError, and refuses trees
deeper than MAX_AST_DEPTH, so that nothing recursive here or in its callers (ast.dump,
ast.unparse, the report) can meet a RecursionError on a candidate's source. meta_harness.py uses it to validate and deduplicate candidates, primitives.py and
tools/headroom.py to splice the domains' PRIMITIVES in. What it leaves out: names bound inside
`if`/`try` blocks at top level (a search axis is a plain top-level def, class or assignment),
and any judgement of what a change does (that is the evaluation's job).
"""
import ast
import re
import sys
import textwrap
from collections import Counter

from jail.sandbox import valid_text  # the one text rule (lone surrogates), at every boundary

MAX_AST_DEPTH = 100  # a harness nests a few dozen levels; ast.unparse recurses ~3 frames a level


def parse(source):
    """ast.parse(source), or SyntaxError for a source that cannot be checked safely: nested
    deeper than MAX_AST_DEPTH, or so deep or large that parsing itself runs out of stack or
    memory (those are a candidate's fault, never the run's)."""
    try:
        tree = ast.parse(source)
    except (RecursionError, MemoryError) as e:
        raise SyntaxError(f"too deeply nested or too large to parse ({type(e).__name__})") from None
    stack = [(tree, 0)]
    while stack:  # (iterative: the depth is what is being checked)
        node, depth = stack.pop()
        if depth > MAX_AST_DEPTH:
            raise SyntaxError(f"nested deeper than {MAX_AST_DEPTH} levels", ("<harness>", getattr(node, "lineno", 1),
                                                                             1, ""))
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return tree


def _defined_names(node):
    """Names a top-level statement binds: def/class names and assignment targets."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _span(node):
    """1-based inclusive line range of a statement, decorators included."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]), node.end_lineno


def top_level_names(source):
    """{name: (first_line, last_line)} for every top-level def/class/assignment, in file order.
    A name bound twice maps to its last binding, the one in effect after import."""
    out = {}
    for node in parse(source).body:
        for name in _defined_names(node):
            out.pop(name, None)
            out[name] = _span(node)
    return out


def _lines(source):
    # Split on "\n" only (keeping it), the way ast counts lines; str.splitlines would also
    # split on form feeds and other separators inside strings and shift every line number.
    return re.findall(r"[^\n]*\n|[^\n]+\Z", source)


def splice(source, name, new_def_source):
    """Replace the top-level definition of `name` by `new_def_source`, which must be ONE
    statement defining exactly `name`. Every other line of `source` stays byte-identical:
    we cut by the ast node's line range instead of unparsing, which would drop comments and
    reformat the file. Raises KeyError if `name` is not defined, ValueError if it cannot be
    spliced cleanly."""
    new_def = textwrap.dedent(new_def_source).strip("\n").rstrip() + "\n"
    new_tree = parse(new_def)
    if len(new_tree.body) != 1 or _defined_names(new_tree.body[0]) != [name]:
        raise ValueError(f"replacement must be one statement defining exactly {name!r}")
    tree = parse(source)
    hits = [i for i, n in enumerate(tree.body) if name in _defined_names(n)]
    if not hits:
        raise KeyError(f"{name!r} is not defined at top level")
    i = hits[-1]  # the binding in effect
    node = tree.body[i]
    if _defined_names(node) != [name]:
        raise ValueError(f"{name!r} is bound together with other names; cannot splice it alone")
    start, end = _span(node)
    for j, other in enumerate(tree.body):  # "A = 1; B = 2" shares a line: refuse, don't mangle B
        if j != i and _span(other)[0] <= end and _span(other)[1] >= start:
            raise ValueError(f"{name!r} shares lines with another statement")
    lines = _lines(source)
    out = "".join(lines[:start - 1]) + new_def + "".join(lines[end:])
    # Verify by re-parsing: the same statements, one of them swapped for the new one.
    out_body = parse(out).body
    want = tree.body[:i] + new_tree.body + tree.body[i + 1:]
    if [ast.dump(n) for n in out_body] != [ast.dump(n) for n in want]:
        raise ValueError(f"splice of {name!r} did not re-parse to the intended program")
    return out


def _strip_docstrings(tree):
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree


def normalized(source):
    """Canonical form for "is this the same program": the ast dump without comments, layout
    or docstrings (a reworded docstring is not a new candidate worth a search set of rollouts)."""
    try:
        return ast.dump(_strip_docstrings(parse(source)))
    except (SyntaxError, ValueError):
        return "unparsable:" + source.strip()


def _keyed_statements(source):
    """Top-level statements keyed by the names they bind (unnamed ones: '<stmt>', numbered),
    the module docstring left out (text, no behaviour)."""
    body = parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    out, seen = {}, Counter()
    for node in body:
        names = _defined_names(node)
        key = ",".join(names) or "<stmt>"
        seen[key] += 1
        out[key if seen[key] == 1 else f"{key}#{seen[key]}"] = (set(names), ast.dump(node))
    return out


def differs_only_in(base_src, cand_src, allowed_names):
    """(True, "") if `cand_src` equals `base_src` except for top-level definitions of
    `allowed_names` (compared as ASTs, so comments and layout do not count), else (False, why).
    This is FST's restriction: a prompt-only search may change the prompt texts, nothing else."""
    allowed = set(allowed_names)
    try:
        base, cand = _keyed_statements(base_src), _keyed_statements(cand_src)
    except SyntaxError as e:
        return False, f"syntax error: {e}"
    for key in sorted(set(base) | set(cand)):
        b, c = base.get(key), cand.get(key)
        names = (b or c)[0]
        if b is not None and c is not None and b[1] == c[1]:
            continue
        if names and names <= allowed:
            continue
        what = "added" if b is None else "removed" if c is None else "changed"
        return False, f"{what} top-level {key!r}, outside the allowed {sorted(allowed)}"
    return True, ""


def static_check(source):
    """Reason the source cannot be a harness, or None: parses, defines run(task, llm, tools)
    at top level, imports only the standard library (the sandbox enforces more at run time)."""
    if not isinstance(source, str) or not source.strip():
        return "empty source (the proposer returned no code)"
    try:
        valid_text(source, "the source")
    except ValueError as e:
        return str(e)
    try:
        tree = parse(source)
    except SyntaxError as e:
        return f"syntax error: {e.msg}" + (f" (line {e.lineno})" if e.lineno else "")
    except ValueError as e:  # null bytes
        return f"unparsable: {e}"
    runs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    if not runs:
        return "no top-level function run(task, llm, tools)"
    a = runs[-1].args
    if len(a.posonlyargs) + len(a.args) < 3 and a.vararg is None:
        return "run must accept (task, llm, tools)"
    for node in ast.walk(tree):
        mods = [x.name for x in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        for m in mods:
            top = m.split(".")[0]
            if top not in sys.stdlib_module_names and top != "__future__":
                return f"imports {m!r}, not in the standard library"
    return None


def docstring(source):
    """A harness's module docstring, or None (also for a source that does not parse)."""
    try:
        return ast.get_docstring(parse(source))
    except (SyntaxError, ValueError):
        return None


def hypothesis(source):
    """The first line of a harness's module docstring: what its author expected it to do."""
    doc = (docstring(source) or "").strip()
    return doc.splitlines()[0][:300] if doc else None


def with_hypothesis(source, line):
    """The source with `line` as its docstring's new first line, the old docstring kept below
    it (a proposer that edits code, not prose, says what it changed and the lineage stays
    readable: newest first). Code is untouched, so normalized() is unchanged. A docstring that
    is not a plain triple-quoted literal is left alone; no docstring: one is added."""
    line = " ".join(str(line).replace("\\", "/").replace('"""', "'''").split())
    try:
        body = parse(source).body
    except (SyntaxError, ValueError):
        return source
    if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        pad = " " if line.endswith('"') else ""  # a quote next to the closing ones would end the literal early
        return f'"""{line}{pad}"""\n' + source
    lines = source.split("\n")
    first = body[0].lineno - 1
    opening = re.match(r'\s*"""', lines[first])
    if not opening or body[0].col_offset != 0:
        return source
    at = opening.end()
    lines[first] = lines[first][:at] + line + "\n\n" + lines[first][at:]
    return "\n".join(lines)
