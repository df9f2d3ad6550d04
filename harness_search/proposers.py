"""proposers.py: who writes the harness candidates of phase B (meta_harness.py runs the search).

One interface: propose(archive_dir, k) -> Proposal(candidates, errors, exhausted, usage): the
candidates as dicts (source, proposer, note, [parent, axis, format, finish, reject, raw]), what
went wrong in this call, whether nothing is left to propose on this archive (primitives' menu),
and what the call cost (calls, chars, tokens, seconds, cost_usd). A plain function returning a
list of candidates is a proposer too (meta_harness.py reads it as Proposal(that list)).
  primitives  offline default: the paper's choice (the archive's top scorer) with one axis of
              domain.PRIMITIVES swapped, then combinations, retries and pairs: primitives.py;
  self        the policy model writes candidates from an archive digest (llm_text callable);
  openai      the same prompt to any OpenAI-compatible /chat/completions endpoint (urllib);
  command     an external coding agent (Claude Code's `claude -p`, Codex's `codex exec`, ...)
              run in a jailed copy of the archive directory, as in the paper: agent_proposer.py.

The LLM proposers (self, openai) see `archive_view.archive_digest`: the leaderboard, the
rejected candidates and why, the best candidate's full source (the parent), the top candidates'
diffs against their parents with the examples each won and lost against that parent, and failed
traces from several candidates, all within a character budget. They may reply with a whole file or with
search/replace edit blocks against the parent (a long harness then costs a short reply); the
parent's source with the edits applied is validated like any candidate. A reply cut by the
length limit is recorded as cut, not as "empty source".

A proposer reads only the archive (harness-split traces, scores, sources), never the
reference answers or the test split. What it leaves out: parallel proposer calls, retries
of a failed LLM call within one iteration (the iteration gets fewer candidates; the search
backs off before the next call). The openai proposer's timeout bounds each request as a whole
(bounded_request), the command proposer's the agent's run with all it started. from_args maps
whale.py's flags onto make_proposer.
"""

import json
import os
import re
import time
import urllib.error
import urllib.request

from harness_search import harness_archive
from harness_search import primitives
from jail import received  # an endpoint is someone else's: its replies capped, redirects same-origin only
from harness_search.archive_view import DIGEST_CHARS, RULES, archive_digest, short
from harness_search.proposal import Proposal  # what every proposer returns
from jail.sandbox import valid_text

# -----------------------------------------------------------------------------
# LLM proposers: the prompt, the reply, the endpoints

EDIT_HELP = """Edit blocks against the parent's source, one per change, each exactly:
<<<<<<< SEARCH
lines copied exactly from the parent (enough of them to occur only once)
=======
the lines that replace them
>>>>>>> REPLACE"""


def build_prompt(domain, archive_dir, i, k, notes, digest_chars=DIGEST_CHARS, reply_format="any", digest=None):
    rules = (harness_archive.read_json(os.path.join(archive_dir, "rules.json"), {}) or {})
    allowed = rules.get("allowed_axes")
    restrict = "" if allowed is None else (
        f"\n- PROMPT-ONLY SEARCH: change ONLY the top-level definitions {allowed} of the best "
        "candidate; every other top-level definition must stay exactly as it is.")
    done = "".join(f"\n- {n}" for n in notes) or " (none yet)"
    whole = "the complete new harness file in a single ```python block"
    reply = {"file": f"then {whole}.",
             "edit": f"then your change as edit blocks against the parent.\n\n{EDIT_HELP}",
             "any": f"then EITHER {whole}, OR (shorter, for a local change) edit blocks against the "
                    f"parent.\n\n{EDIT_HELP}"}[reply_format]
    if digest is None:
        digest = archive_digest(archive_dir, digest_chars)
    return (f"You improve the harness (the Python code around a language model) of an agent.\n\n"
            f"## Task\n{domain.SKILL}\n\n{RULES}{restrict}\n\n{digest}\n\n"
            f"## Your job\nWrite candidate {i + 1} of {k} for this iteration. Mechanisms already "
            f"proposed this iteration:{done}\nReply with one line `Mechanism: <one sentence>`, {reply}")


def _strip_think(text):
    return re.sub(r"<think>.*?</think>", "", str(text), flags=re.S)


def extract_code(text):
    """The last ```python block that defines run (else the last block); "" if none. A closing
    fence must stand on its own line, so a harness that itself parses ``` in model output is
    not cut in half."""
    blocks = re.findall(r"^```(?:python|py)?[ \t]*\n(.*?)^```[ \t]*$", _strip_think(text), flags=re.S | re.M)
    with_run = [b for b in blocks if re.search(r"^def run\(", b, re.M)]
    code = (with_run or blocks or [""])[-1]
    return code.strip("\n") + "\n" if code.strip() else ""


def extract_note(text):
    m = re.search(r"Mechanism:\s*(.+)", _strip_think(text))
    return m.group(1).strip()[:300] if m else "(no Mechanism: line)"


EDIT_BLOCK = re.compile(r"^<{5,9} ?SEARCH[ \t]*\n(.*?)^={5,9}[ \t]*\n(.*?)^>{5,9} ?REPLACE[ \t]*$", re.S | re.M)
EDIT_OPEN = re.compile(r"^<{5,9} ?SEARCH[ \t]*$", re.M)


def apply_edits(source, edits):
    """Apply (search, replace) pairs in order, the way coding agents' search/replace blocks
    work: each search text must occur exactly once in the current text. An exact match first,
    then one that ignores trailing whitespace on each line. Raises ValueError(why)."""
    out = source
    for j, (old, new) in enumerate(edits, 1):
        if not old.strip():
            raise ValueError(f"edit {j}: empty SEARCH text")
        n = out.count(old)
        if n > 1:
            raise ValueError(f"edit {j}: the SEARCH text occurs {n} times in the parent; include more lines")
        if n == 1:
            out = out.replace(old, new, 1)
            continue
        lines, want = out.splitlines(keepends=True), [x.rstrip() for x in old.splitlines()]
        hits = [i for i in range(len(lines) - len(want) + 1)
                if [x.rstrip() for x in lines[i:i + len(want)]] == want]
        if len(hits) != 1:
            first = next((x for x in want if x.strip()), "")
            raise ValueError(f"edit {j}: the SEARCH text is not in the parent "
                             f"({'found ' + str(len(hits)) + ' times' if hits else 'first line ' + repr(first[:80])})")
        i = hits[0]
        new = new if not new or new.endswith("\n") else new + "\n"
        out = "".join(lines[:i]) + new + "".join(lines[i + len(want):])
    return out


def candidate_from_reply(text, parent_source, finish=None):
    """A reply -> dict(source, format, reject). Edit blocks (if any) are applied to the parent;
    else the whole file from its ```python block. `reject` is set when the reply cannot be a
    candidate for a reason the validator would not see: cut by the length limit before the code
    was complete, an edit block left open, an edit that does not apply."""
    text = _strip_think(text)
    blocks, opened = EDIT_BLOCK.findall(text), len(EDIT_OPEN.findall(text))
    cut = finish == "length"
    if blocks or opened:
        if opened > len(blocks):
            why = ("reply cut at the length limit (finish_reason=length) inside an edit block; raise "
                   "--proposer-max-tokens") if cut else "an edit block without its ======= or >>>>>>> REPLACE line"
            return dict(source="", format="edit", reject=why)
        if parent_source is None:
            return dict(source="", format="edit", reject="edit blocks, but the archive has no parent to apply them to")
        try:
            return dict(source=apply_edits(parent_source, blocks), format="edit", reject=None)
        except ValueError as e:
            return dict(source="", format="edit", reject=f"edit format: {e}")
    code = extract_code(text)
    if not code and cut:
        return dict(source="", format="file", reject="reply cut at the length limit (finish_reason=length) before a "
                    "complete ```python block; raise --proposer-max-tokens or reply with edit blocks")
    return dict(source=code, format="file", reject=None)


def _llm_proposer(name, domain, ask, digest_chars, reply_format="any", transport_errors=()):
    """Shared by self and openai: K independent calls, each told what the earlier ones chose.
    ask(prompt) -> (text, usage dict, finish reason). A failed call costs its candidate, never
    the run; a transport failure (endpoint down, an HTTP error) ends the batch instead of
    waiting out K timeouts."""
    def propose(archive_dir, k):
        errors, spent = [], dict(calls=0, prompt_chars=0, completion_chars=0, prompt_tokens=0,
                                 completion_tokens=0, seconds=0.0, cut=0)
        parent = harness_archive.paper_choice(harness_archive.load_archive(archive_dir))
        digest = archive_digest(archive_dir, digest_chars)  # the archive does not change within a call
        out, notes = [], []
        for i in range(k):
            prompt = build_prompt(domain, archive_dir, i, k, notes, digest_chars, reply_format, digest)
            spent["calls"] += 1
            spent["prompt_chars"] += len(prompt)
            t0 = time.time()
            try:
                text, usage, finish = ask(prompt)
                valid_text(text, f"the {name} reply")  # a lone surrogate (a JSON "\\ud800"): a failed call
            except Exception as e:
                detail = f": {short(getattr(e, 'body', ''), 200)}" if getattr(e, "body", "") else ""
                errors.append(f"{name} call {i + 1}/{k}: {type(e).__name__}: {short(e, 300)}{detail}")
                if isinstance(e, transport_errors):
                    break
                continue
            finally:
                spent["seconds"] += time.time() - t0
            spent["completion_chars"] += len(text)
            spent["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
            spent["completion_tokens"] += int(usage.get("completion_tokens") or 0)
            spent["cut"] += finish == "length"
            note = extract_note(text)
            notes.append(note)
            cand = candidate_from_reply(text, parent["source"] if parent else None, finish)
            out.append(dict(cand, proposer=name, note=note, raw=text, finish=finish,
                            parent=parent["name"] if parent else None))
        return Proposal(out, errors, False, spent)
    return propose


def _openai_ask(base_url, model, api_key, max_tokens, timeout):
    base = base_url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    chosen = [model]

    def get_model():
        # vLLM and Ollama want the served model's name; if none was given, ask the server.
        if chosen[0] is None:
            req = urllib.request.Request(base + "/models", headers=headers)
            chosen[0] = received.loads(received.http_body(req, timeout), "the /models reply")["data"][0]["id"]
        return chosen[0]

    def ask(prompt):
        body = dict(model=get_model(), messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
        req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
        data = received.loads(received.http_body(req, timeout), "the chat completion")
        choice = data["choices"][0]
        text, finish = choice["message"].get("content"), choice.get("finish_reason")
        if text is None and finish == "length":
            text = ""  # a reasoning model cut before it wrote any content
        if not isinstance(text, str):
            raise ValueError("reply has no text content")
        return text, data.get("usage") or {}, finish
    return ask


# -----------------------------------------------------------------------------

def endpoint_error(base_url, model=None, api_key=None, timeout=10.0):
    """None if an OpenAI-compatible endpoint answers a one-token chat request with a reply
    that has text, else why not (one line). It costs one tiny request, so a down or garbage
    endpoint is reported when the run starts, not after its first weight phase."""
    ask = _openai_ask(base_url, model, api_key, max_tokens=1, timeout=timeout)
    try:
        ask("Say OK.")
    except urllib.error.HTTPError as e:
        hint = " (give --proposer-model if it lists no models)" if model is None and e.code == 404 else ""
        return f"proposer endpoint {base_url} answered HTTP {e.code} {e.reason}{hint}"
    except (urllib.error.URLError, OSError) as e:
        return f"proposer endpoint {base_url} is not reachable: {getattr(e, 'reason', e)}"
    except (ValueError, KeyError, IndexError, TypeError) as e:  # JSONDecodeError is a ValueError
        return f"proposer endpoint {base_url} answers garbage, not an OpenAI chat completion ({type(e).__name__})"
    return None


def make_proposer(name, domain, *, llm_text=None, base_url=None, model=None, api_key=None,
                  api_key_env="OPENAI_API_KEY", command=None, rng_seed=0, max_tokens=4096, timeout=None,
                  digest_chars=DIGEST_CHARS, reply_format="any", workdir_root=None, agent_env=(), private=(),
                  hosts=None, ties="older", merge=True):
    """propose(archive_dir, k) -> Proposal(candidates, errors, exhausted, usage): the candidates as
    [dict(source, proposer, note, [parent, axis, format, reject, raw])], this call's errors and cost.
    max_tokens: the LLM reply's length limit; timeout: seconds per LLM request as a whole, from
    connect to the last byte (openai, default 600) or per agent run with everything it started
    (command, default 1800); reply_format: what the LLM is asked for (file | edit | any; replies
    of either form are accepted); agent_env: names of variables the agent gets besides the
    basics (agent_jail.py); private: more paths the agent must never read; hosts: what its
    agent may reach through the jail's egress proxy (None: agent_jail.DEFAULT_HOSTS); ties: which
    of the top scorers the primitives proposer edits (primitives.parent_of); merge: whether it proposes
    merges of lineages (primitives.merges)."""
    if reply_format not in ("any", "file", "edit"):
        raise ValueError(f"unknown reply format {reply_format!r}; expected any, file or edit")
    if name == "primitives":
        return primitives.proposer(domain, rng_seed, ties, merge)
    if name == "self":
        if llm_text is None:
            raise ValueError("the self proposer needs llm_text(prompt, max_tokens) -> str")

        def ask(prompt):
            out = llm_text(prompt, max_tokens)
            if isinstance(out, dict):  # an engine may also report token counts and why it stopped
                return str(out.get("text", "")), out, out.get("finish")
            return str(out), {}, None
        return _llm_proposer("self", domain, ask, digest_chars, reply_format)
    if name == "openai":
        base_url = base_url or os.environ.get("WHALE_PROPOSER_URL")
        if not base_url:
            raise ValueError("the openai proposer needs base_url or WHALE_PROPOSER_URL")
        ask = _openai_ask(base_url, model or os.environ.get("WHALE_PROPOSER_MODEL"),
                          api_key or os.environ.get(api_key_env or ""), max_tokens, timeout or 600.0)
        return _llm_proposer("openai", domain, ask, digest_chars, reply_format,
                             transport_errors=(urllib.error.URLError, ConnectionError, TimeoutError))
    if name == "command":
        if not command:
            raise ValueError("the command proposer needs command, e.g. 'claude -p'")
        from harness_search import agent_proposer  # (imported when asked for: it builds on this file's digest and signatures)
        return agent_proposer.command_proposer(domain, command, timeout or 1800.0, digest_chars, workdir_root,
                                               agent_env, private, hosts)
    raise ValueError(f"unknown proposer {name!r}; expected primitives, self, openai or command")


def from_args(a, domain, llm_text=None, run_dir=None):
    """The proposer whale.py's flags (a: whale.Args) ask for. llm_text(prompt, max_tokens): the
    policy model, for the `self` proposer (rollout.text_sampler); the command proposer's agent
    never reads run_dir."""
    return make_proposer(a.proposer, domain, llm_text=llm_text, base_url=a.proposer_url or None,
                         model=a.proposer_model or None, api_key_env=a.proposer_api_key_env,
                         command=a.proposer_command or None, rng_seed=a.seed, max_tokens=a.proposer_max_tokens,
                         timeout=a.proposer_timeout or None, digest_chars=a.proposer_digest_chars,
                         reply_format=a.proposer_format,
                         agent_env=[x.strip() for x in a.proposer_env.split(",") if x.strip()],
                         private=[str(run_dir)] if run_dir else [],
                         hosts=[x.strip() for x in a.proposer_hosts.split(",") if x.strip()], ties=a.proposer_ties,
                         merge=a.proposer_merge == "on")
