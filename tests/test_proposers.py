"""
The proposers (harness_search/: proposers.py, agent_proposer.py, archive_view.py): replies, edit
blocks, cut replies, the archive digest, usage; LLM and agent proposers end to end through whale.py.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import meta_harness as mh
from domains import searchqa
from harness_search import agent_proposer
from harness_search import archive_view
from harness_search import harness_archive
from harness_search import harness_source as hsrc
from harness_search import proposers
from jail import isolation
from tests.helpers import (
    DOMAIN, E2E, EXAMPLES, H0, archive_with_history, e2e_run, make_evaluate, ok_validate,
    openai_server, quiet, run_whale, stop_after)


# ---- LLM and agent proposers: replies, edit blocks, cut replies, the archive digest, usage -----

REPLY = "Mechanism: ask for a short answer.\n```python\n" + hsrc.splice(H0, "QUALITY", "QUALITY = 0.7") + "```\n"


def test_openai_proposer_against_local_server(tmp_path):
    d = str(tmp_path / "arch")
    server, url = openai_server(then={"content": REPLY})
    try:
        assert proposers.endpoint_error(url) is None  # the start-up probe: a one-token chat request
        server.requests.clear()
        prop = proposers.make_proposer("openai", DOMAIN, base_url=url, api_key="k", timeout=10)
        res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d, k=2,
                              should_stop=stop_after(2), log=quiet)
    finally:
        server.shutdown()
    arch = harness_archive.load_archive(d)
    assert arch[1]["scores"] is not None and arch[1]["meta"]["note"] == "ask for a short answer."
    assert arch[2]["invalid"].startswith("duplicate of cand_001")  # the server always says the same
    requests = [q["body"] for q in server.requests]
    assert requests[0]["model"] == "served-model" and DOMAIN.SKILL in requests[0]["messages"][0]["content"]
    assert "### example" in requests[0]["messages"][0]["content"]  # traces are in the digest
    assert {q["auth"] for q in server.requests} == {"Bearer k"}
    assert res["incumbent"] == "cand_001"
    assert res["counters"]["proposer_calls"] == len(requests) == 2  # the usage the server reported, summed
    assert res["counters"]["proposer_prompt_tokens"] == sum(len(q["messages"][-1]["content"]) // 4 for q in requests)


def test_openai_proposer_survives_garbage_and_down_endpoint(tmp_path):
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    server, url = openai_server(then={"raw": b"<html>502 nonsense"})
    try:
        prop = proposers.make_proposer("openai", DOMAIN, base_url=url, model="m", timeout=5)
        proposal = prop(d, 3)
        assert proposal.candidates == [] and len(proposal.errors) == 3 and len(server.requests) == 3
    finally:
        server.shutdown()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prop = proposers.make_proposer("openai", DOMAIN, base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout=5)
    proposal = prop(d, 3)
    assert proposal.candidates == [] and len(proposal.errors) == 1  # gives up after the first refused connection
    # and inside a search: an iteration with zero candidates, logged, no crash
    events = []
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d,
                          should_stop=stop_after(2), log=events.append)
    assert res["iterations"] == 2 and any(e["event"] == "proposer_error" for e in events)


def test_self_proposer_prompt_and_bad_replies(tmp_path):
    d = str(tmp_path / "arch")
    prompts = []
    replies = [REPLY, "I would rather not write code.", "```python\nX = 1\n```"]

    def llm_text(prompt, max_tokens):
        prompts.append(prompt)
        return replies.pop(0)
    prop = proposers.make_proposer("self", DOMAIN, llm_text=llm_text)
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d, k=3,
                    should_stop=stop_after(2), log=quiet)
    assert DOMAIN.SKILL in prompts[0] and "No pure parameter tweaks" in prompts[0]
    assert "cand_000" in prompts[0] and "### example" in prompts[0]
    assert "ask for a short answer." in prompts[1]  # later calls see earlier mechanisms
    arch = harness_archive.load_archive(d)
    assert arch[1]["scores"] is not None
    assert arch[2]["invalid"].startswith("empty source") and os.path.exists(os.path.join(arch[2]["dir"], "reply.txt"))
    assert arch[3]["invalid"].startswith("no top-level function run")


def test_proposer_reply_or_candidate_with_a_lone_surrogate_is_a_failed_call_or_an_invalid_candidate(tmp_path):
    """Issue 35: a JSON "\\ud800" in an OpenAI-compatible reply is a failed proposer call (it
    crashed the run writing harness.py); a candidate source with one is an invalid candidate,
    archived with U+FFFD in its place, and the search goes on."""
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    server, url = openai_server([{"content": REPLY.replace("short answer", "short \ud800 answer")}, {"content": REPLY}])
    try:
        prop = proposers.make_proposer("openai", DOMAIN, base_url=url, model="m", timeout=10)
        proposal = prop(d, 2)
    finally:
        server.shutdown()
    cands = proposal.candidates
    assert len(cands) == 1 and cands[0]["note"] == "ask for a short answer."
    assert len(proposal.errors) == 1 and "openai reply is not valid Unicode (a lone surrogate U+D800" in proposal.errors[0]
    bad = H0.replace("QUALITY = 0.2", "QUALITY = 0.9  # \udfff")
    events = []
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate,
                          lambda archive_dir, k: [dict(source=bad, note="a \ud800 note"), dict(source=REPLY)],
                          archive_dir=d, should_stop=stop_after(2), log=events.append)
    c = harness_archive.load_archive(d)[1]
    assert c["scores"] is None and c["invalid"].startswith("the candidate's source is not valid Unicode")
    assert c["source"] == bad.replace("\udfff", "\ufffd") and c["meta"]["note"] == "a \ufffd note"
    assert hsrc.static_check(bad).startswith("the source is not valid Unicode")
    assert res["iterations"] == 2 and [e["status"] for e in events if e["event"] == "harness_candidate"][-2] == "invalid"

    def agent(archive_dir, k):  # a proposer whose error text (e.g. an agent's JSON output) holds one
        return proposers.Proposal([], ["agent reported an error: \udc80"])
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, agent, archive_dir=d,
                    should_stop=stop_after(3), log=events.append)
    said = [e["reason"] for e in events if e["event"] == "proposer_error"]
    assert said[-1] == "agent reported an error: \ufffd"  # the console and metrics.jsonl get valid text
    assert harness_archive.read_jsonl(os.path.join(d, "iterations.jsonl"))[-1]["proposer_errors"] == [said[-1]]


@pytest.mark.slow
def test_archive_written_before_the_text_rule_resumes_and_reaches_the_tokenizer_clean(tmp_path, hf):
    """Issue 35: what a run that crashed on a lone surrogate had written: traces with "\\ud800"
    escapes (json.dumps wrote them; json.loads turns them back into surrogates) and an empty
    invalid.txt (the write that crashed). The resumed search finishes that candidate with the
    error text kept as U+FFFD, and the self proposer's prompt, built from those traces, goes
    through the real tokenizer."""
    d = tmp_path / "arch"
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=str(d),
                    should_stop=stop_after(1), log=quiet)
    traces = d / "cand_000" / "traces.jsonl"
    recs = [json.loads(line) for line in traces.read_text().splitlines()]
    for r in recs:
        r.update(answer="yes \ud800", stdout="out \udfff", error="E \udc80")
        r["calls"][0]["text"] = "x \ud800"
    traces.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert "\\ud800" in traces.read_text()
    (d / "cand_001").mkdir()
    (d / "cand_001" / "harness.py").write_text(H0.replace("QUALITY = 0.2", "QUALITY = 0.3"))
    harness_archive.write_json(str(d / "cand_001" / "meta.json"), dict(iteration=1, proposer="self", parent="cand_000"))
    (d / "cand_001" / "invalid.txt").write_text("")
    prompts = []

    def llm_text(prompt, max_tokens):
        prompts.append(prompt)
        hf.chat_ids([{"role": "user", "content": prompt}])  # the tokenizer raised TypeError on a surrogate
        return REPLY
    prop = proposers.make_proposer("self", DOMAIN, llm_text=llm_text)
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), lambda src: "error: ValueError: bad \ud800"
                          if "0.3" in src else None, prop, archive_dir=str(d), k=1, should_stop=stop_after(3), log=quiet)
    arch = harness_archive.load_archive(str(d))
    assert arch[1]["invalid"] == "error: ValueError: bad \ufffd\n"
    assert not any(line["proposer_errors"] for line in harness_archive.read_jsonl(str(d / "iterations.jsonl")))
    assert len(prompts) == 1 and "\ufffd" in prompts[0] and arch[2]["scores"] is not None
    assert all(r["answer"] == "yes \ufffd" for r in harness_archive.read_traces(arch[0]))
    assert res["iterations"] == 3


@pytest.mark.slow
def test_command_proposer_collects_files_and_survives_timeout(tmp_path):
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    script = tmp_path / "agent.py"
    body = hsrc.splice(H0, "QUALITY", "QUALITY = 0.6").replace('"""Toy harness."""', '"""Higher quality."""')
    script.write_text(textwrap.dedent(f'''\
        import os, sys
        assert os.path.exists("PROPOSE.md") and "new/cand_" in sys.stdin.read()
        open("new/cand_1.py", "w").write({body!r})
        open("new/cand_2.py", "w").write("broken(")
        '''))
    prop = proposers.make_proposer("command", DOMAIN, command=f"{sys.executable} {script}", timeout=30)
    proposal = prop(d, 2)
    cands = proposal.candidates
    assert [c["note"] for c in cands][0] == "Higher quality." and len(cands) == 2
    assert proposal.usage["calls"] == 1 and proposal.usage["prompt_chars"] > 0
    slow = proposers.make_proposer("command", DOMAIN, command="sleep 30", timeout=0.5)(d, 2)
    assert slow.candidates == [] and any("timed out" in e for e in slow.errors)


def test_edit_blocks_apply_to_the_parent_or_say_why_not():
    block = lambda old, new: f"<<<<<<< SEARCH\n{old}=======\n{new}>>>>>>> REPLACE\n"  # noqa: E731
    reply = "Mechanism: more quality.\n```\n" + block("QUALITY = 0.2\n", "QUALITY = 0.7\n") + "```\n"
    c = proposers.candidate_from_reply(reply, H0)
    assert c["format"] == "edit" and c["reject"] is None and c["source"] == H0.replace("QUALITY = 0.2", "QUALITY = 0.7")
    # trailing blanks in the SEARCH text are forgiven; two edits apply in order
    two = block("TOP_K = 1  # retrieval depth   \n", "TOP_K = 2\n") + block("TOP_K = 2\n", "TOP_K = 4\n")
    assert "TOP_K = 4\n" in proposers.candidate_from_reply(two, H0)["source"]
    for edits, why in [(block("QUALITY = 0.9\n", "x = 1\n"), "not in the parent"),
                       (block("", "x = 1\n"), "empty SEARCH"),
                       ("<<<<<<< SEARCH\nQUALITY = 0.2\n=======\nQUALITY =", "without its")]:
        c = proposers.candidate_from_reply(edits, H0)
        assert c["source"] == "" and why in c["reject"], (why, c)
    with pytest.raises(ValueError, match="occurs 2 times"):
        proposers.apply_edits(H0, [("    return ", "    return 1 + ")])
    # cut by the length limit: inside an edit block, or before the code block closed -> "cut", not "empty"
    assert "cut at the length limit" in proposers.candidate_from_reply(block("A", "B")[:30], H0, "length")["reject"]
    cut = proposers.candidate_from_reply("Mechanism: x\n```python\n" + H0[:120], H0, "length")
    assert cut["format"] == "file" and "cut at the length limit" in cut["reject"]
    whole = proposers.candidate_from_reply(REPLY + "and then the model rambled on", H0, "length")
    assert whole["reject"] is None and "QUALITY = 0.7" in whole["source"]  # the code was complete: kept


def test_archive_digest_shows_diffs_outcomes_and_traces_of_several_candidates(tmp_path):
    d = str(tmp_path / "arch")
    arch = archive_with_history(d)
    text = archive_view.archive_digest(d, 16000)
    c1, c0 = arch[1], arch[0]
    won, lost = archive_view.outcomes_vs(c1, c0)
    assert won and not lost  # QUALITY 0.5 beats 0.2 on exactly the examples with u in [0.2, 0.5)
    assert f"### cand_001: success {c1['scores']['success']:.3f} vs its parent cand_000" in text
    assert f"better on {len(won)}, worse on 0 of 40" in text and f"better on: {won[0]}, " in text
    assert "-QUALITY = 0.2\n+QUALITY = 0.5\n" in text                       # the diff itself
    assert "cand_003: syntax error" in text                               # rejected, with the reason
    best = harness_archive.paper_choice(arch)
    assert f"full source of the best candidate, {best['name']}" in text and best["source"] in text
    traced = set(re.findall(r"^\[(cand_\d+), failed\]", text, re.M))
    assert len(traced) >= 2 and "### example" in text                      # failed traces of several
    for budget in (2000, 6000, 40000):
        assert len(archive_view.archive_digest(d, budget)) <= budget


def test_openai_reply_cut_by_the_length_limit_is_recorded_as_cut(tmp_path):
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    edit = "Mechanism: more quality.\n<<<<<<< SEARCH\nQUALITY = 0.2\n=======\nQUALITY = 0.6\n>>>>>>> REPLACE\n"
    server, url = openai_server([{"content": "Mechanism: long.\n```python\n" + H0[:100], "finish_reason": "length"},
                                 {"content": edit, "finish_reason": "stop"}])
    try:
        prop = proposers.make_proposer("openai", DOMAIN, base_url=url, model="m", timeout=10, max_tokens=333)
        mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d, k=2,
                        should_stop=stop_after(2), log=quiet)
    finally:
        server.shutdown()
    arch = harness_archive.load_archive(d)
    requests = [q["body"] for q in server.requests]
    assert [r["max_tokens"] for r in requests] == [333, 333]
    assert "cut at the length limit" in arch[1]["invalid"] and arch[1]["meta"]["finish"] == "length"
    assert arch[2]["meta"]["format"] == "edit" and arch[2]["scores"] is not None
    assert arch[2]["source"] == H0.replace("QUALITY = 0.2", "QUALITY = 0.6") and arch[2]["meta"]["parent"] == "cand_000"
    assert "<<<<<<< SEARCH" in requests[0]["messages"][0]["content"]


def test_agent_usage_reads_claude_and_codex_json():
    claude = {"type": "result", "subtype": "success", "is_error": False, "result": "done", "num_turns": 4,
              "total_cost_usd": 0.0421, "usage": {"input_tokens": 12, "cache_creation_input_tokens": 3000,
                                                  "cache_read_input_tokens": 9000, "output_tokens": 800}}
    u = agent_proposer.agent_usage(json.dumps(claude))
    assert (u["prompt_tokens"], u["completion_tokens"], u["cost_usd"], u["errors"]) == (12012, 800, 0.0421, [])
    stream = "\n".join(json.dumps(x) for x in [{"type": "system", "subtype": "init"}, {"type": "assistant"}, claude])
    assert agent_proposer.agent_usage(stream)["cost_usd"] == 0.0421                     # stream-json: the last line
    bad = agent_proposer.agent_usage(json.dumps({**claude, "is_error": True, "subtype": "error_max_turns"}))
    assert "error_max_turns" in bad["errors"][0]
    codex = [{"type": "thread.started", "thread_id": "t"}, {"type": "turn.started"},
             {"type": "item.completed", "item": {"id": "item_0", "type": "agent_message", "text": "ok"}},
             {"type": "turn.completed", "usage": {"input_tokens": 24763, "cached_input_tokens": 24448,
                                                  "output_tokens": 122}},
             {"type": "turn.completed", "usage": {"input_tokens": 100, "cached_input_tokens": 0, "output_tokens": 8}}]
    u = agent_proposer.agent_usage("banner line\n" + "\n".join(json.dumps(x) for x in codex))
    assert (u["prompt_tokens"], u["completion_tokens"], u["cost_usd"]) == (24863, 130, 0.0) and u["reported"]
    failed = agent_proposer.agent_usage(json.dumps({"type": "turn.failed", "error": {"message": "stream ended"}}))
    assert "stream ended" in failed["errors"][0]
    assert agent_proposer.agent_usage("I wrote the files.")["reported"] is False


# ---- LLM and agent proposers end to end, through whale.py (real processes) ---------------------

AGENT_STANDIN = r'''
"""Stand-in for the coding-agent CLIs of the README's recipes, Claude Code's `claude -p` and
Codex's `codex exec` (which one: the name it is run as). It parses their flags (an unknown flag is
an error, as in the real CLIs; without write permission it writes nothing), reads the prompt from
stdin as they do, acts on its working directory as the test's plan (FAKE_AGENT_PLAN) says for
this call (the plan is JSON in that variable), and prints the JSON its original prints: Claude's
one result object, Codex's JSONL."""
import argparse, json, os, sys

kind = os.path.basename(sys.argv[0])
if kind == "claude":
    p = argparse.ArgumentParser(prog="claude")
    p.add_argument("prompt", nargs="?")
    p.add_argument("-p", "--print", action="store_true")
    p.add_argument("--output-format", choices=["text", "json", "stream-json"], default="text")
    p.add_argument("--permission-mode", choices=["default", "acceptEdits", "plan", "bypassPermissions"],
                   default="default")
    p.add_argument("--allowedTools", "--allowed-tools", default="")
    p.add_argument("--max-turns", type=int)
    p.add_argument("--model")
    a = p.parse_args()
    if not a.print:
        sys.exit("stand-in: only headless mode (-p) is scripted")
    may_write = a.permission_mode in ("acceptEdits", "bypassPermissions")
else:
    p = argparse.ArgumentParser(prog="codex")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("exec")
    e.add_argument("prompt", nargs="?")
    e.add_argument("--json", action="store_true")
    e.add_argument("--skip-git-repo-check", action="store_true")
    e.add_argument("-s", "--sandbox", choices=["read-only", "workspace-write", "danger-full-access"],
                   default="read-only")
    e.add_argument("--full-auto", action="store_true")
    e.add_argument("-m", "--model")
    e.add_argument("--ephemeral", action="store_true")
    a = p.parse_args()
    d = os.getcwd()
    while d != "/" and not os.path.exists(os.path.join(d, ".git")):
        d = os.path.dirname(d)
    if not a.skip_git_repo_check and not os.path.exists(os.path.join(d, ".git")):
        sys.exit("Not inside a trusted directory and --skip-git-repo-check was not specified.")
    may_write = a.full_auto or a.sandbox != "read-only"
prompt = a.prompt if a.prompt not in (None, "-") else sys.stdin.read()
if not prompt.strip():
    sys.exit("Error: Input must be provided either through stdin or as a prompt argument when using --print")
assert "new/cand_1.py" in prompt and "## Task" in prompt, "not a whale proposer prompt"
plan = json.loads(os.environ["FAKE_AGENT_PLAN"])  # it gets the variable only if --proposer-env names it
# the n-th call of a search (counted from its copy of the archive: it can read and write nothing else)
n = max(0, len(open("iterations.jsonl").read().splitlines()) - 1) if os.path.exists("iterations.jsonl") else 0
step = plan[n] if n < len(plan) else {}
written = []
if may_write:
    base = open("cand_000/harness.py").read()
    for name, (doc, extra) in step.get("derive", {}).items():  # a candidate built on cand_000
        open(name, "w").write('"""' + doc + '"""\n' + base + extra)
        written.append(name)
    for name, text in step.get("write", {}).items():
        open(name, "w").write(text)
        written.append(name)
    for name, target in step.get("symlink", {}).items():
        try:
            os.symlink(target, name)
        except OSError as e:  # a refused tool call: the real CLIs report it and go on
            print(f"refused: symlink {name}: {e}", file=sys.stderr)
    for name, fields in step.get("edit_json", {}).items():
        obj = json.load(open(name))
        obj.update(fields)
        json.dump(obj, open(name, "w"))
message = f"Wrote {', '.join(written) or 'nothing'}."
u = step.get("usage", {})
if kind == "claude":
    result = {"type": "result", "subtype": "success", "is_error": False, "duration_ms": 1200, "num_turns": 3,
              "result": message, "session_id": "0e639165-79b1-4bd4-bb0f-4cb4c15115d4",
              "total_cost_usd": step.get("cost_usd", 0.0),
              "usage": {"input_tokens": u.get("input", 0), "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": u.get("cached", 0), "output_tokens": u.get("output", 0)},
              "permission_denials": [] if may_write else [{"tool_name": "Write"}]}
    print(json.dumps(result) if a.output_format == "json" else message)
elif a.json:
    events = [{"type": "thread.started", "thread_id": "0199a213-81c0-7800-8aa1-bbab2a035a53"},
              {"type": "turn.started"}]
    events += [{"type": "item.completed", "item": {"id": f"item_{i}", "type": "file_change", "status": "completed",
                                                  "changes": [{"path": w, "kind": "add"}]}} for i, w in enumerate(written)]
    events += [{"type": "item.completed", "item": {"id": "item_9", "type": "agent_message", "text": message}},
               {"type": "turn.completed", "usage": {"input_tokens": u.get("input", 0) + u.get("cached", 0),
                                                    "cached_input_tokens": u.get("cached", 0),
                                                    "output_tokens": u.get("output", 0)}}]
    print("\n".join(json.dumps(x) for x in events))
else:
    print(message)
'''


def agent_bin(tmp_path, plan):
    """A bin directory with stand-ins named claude and codex, and the plan they follow (pass
    --proposer-env FAKE_AGENT_PLAN: the agent's environment is scrubbed)."""
    b = tmp_path / "bin"
    b.mkdir()
    (b / "agent_standin.py").write_text(f"#!{sys.executable}\n" + AGENT_STANDIN)
    (b / "agent_standin.py").chmod(0o755)
    for name in ("claude", "codex"):
        (b / name).symlink_to(b / "agent_standin.py")
    return {"PATH": f"{b}{os.pathsep}{os.environ['PATH']}", "FAKE_AGENT_PLAN": json.dumps(plan)}


def sq_replies(harness_src):
    """Recorded replies for searchqa: a whole file, a cut one, an edit against any parent."""
    whole = hsrc.splice(harness_src, "make_query", searchqa.PRIMITIVES["make_query"][0])
    nudge = 'NUDGE = "Give your final answer inside <answer></answer>."\n'
    assert harness_src.count(nudge) == 1
    edit = ("Mechanism: a nudge that asks for the short answer only.\n<<<<<<< SEARCH\n" + nudge +
            '=======\nNUDGE = "Answer with the exact words from the passage, inside <answer></answer>."\n'
            ">>>>>>> REPLACE\n")
    return dict(whole={"content": f"Mechanism: rewrite the query.\n```python\n{whole}```\n"},
                cut={"content": "Mechanism: a longer one.\n```python\n" + harness_src[:400], "finish_reason": "length"},
                edit={"content": edit}, http500={"status": 500})


@pytest.mark.slow
def test_harness_only_run_with_openai_proposer_against_a_replaying_server(tmp_path, tiny_harness):
    """A whole-file reply (valid), a cut reply (rejected as cut), an edit-format reply (applied to
    the parent, valid), then HTTP 500s: the phase ends after 3 empty iterations, backing off."""
    r = sq_replies(Path(tiny_harness).read_text())
    server, url = openai_server([r["whole"], r["cut"], r["edit"], r["http500"]])
    out = tmp_path / "run"
    try:
        res = run_whale("--domain", "searchqa", "--method", "harness-only", "--out", str(out), *E2E,
                        "--harness", tiny_harness, "--proposer", "openai", "--proposer-url", url,
                        "--proposer-api-key-env", "WHALE_TEST_PROPOSER_KEY",
                        env={"WHALE_TEST_PROPOSER_KEY": "key-123"}, timeout=600)
    finally:
        server.shutdown()
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert arch["cand_001"]["scores"] and arch["cand_001"]["meta"]["format"] == "file"
    assert "cut at the length limit" in arch["cand_002"]["invalid"]
    c3 = arch["cand_003"]
    assert c3["scores"] and c3["meta"]["format"] == "edit" and "exact words from the passage" in c3["source"]
    assert c3["source"] == proposers.apply_edits(arch[c3["meta"]["parent"]]["source"],
                                                 proposers.EDIT_BLOCK.findall(r["edit"]["content"]))
    assert len(its) == 6 and its[-1]["stop_reason"] == "3 iterations in a row without a valid candidate"
    assert any("HTTP" in e and "500" in e for e in its[2]["proposer_errors"])
    requests = server.requests
    chats = [q for q in requests if q["body"]["max_tokens"] != 1]
    assert len(chats) == s["proposer_calls"] == 7 and {q["body"]["max_tokens"] for q in chats} == {4096}
    assert {q["auth"] for q in requests} == {"Bearer key-123"}
    assert {q["body"]["model"] for q in requests} == {"served-model"}  # the one GET /models named
    assert "### cand_001: success" in chats[2]["body"]["messages"][0]["content"]  # its diff vs the parent
    assert s["proposer_prompt_tokens"] == sum(len(q["body"]["messages"][-1]["content"]) // 4 for q in chats[:3])
    assert s["harness_candidates"] == 3 and s["harness_invalid"] == 1 and s["proposer_seconds"] > 0
    kinds = [e["event"] for e in events]
    for k in ("harness_candidate", "proposer_error", "proposer_backoff", "harness_iteration", "harness_phase_end"):
        assert k in kinds, k
    assert kinds.count("harness_candidate") == 4 and kinds.count("harness_iteration") == 6  # one line per event
    ended = [line for line in res.stdout.splitlines() if "B0 ends after iteration 5" in line]  # on the console, short
    assert ended and "without a valid candidate" in ended[0] and len(ended[0]) <= 120


@pytest.mark.slow
def test_whale_run_with_openai_proposer_edit_reply_and_http_500(tmp_path, tiny_harness):
    r = sq_replies(Path(tiny_harness).read_text())
    server, url = openai_server([r["edit"], r["http500"]])
    out = tmp_path / "run"
    try:
        res = run_whale("--domain", "searchqa", "--method", "whale", "--out", str(out), *E2E, "--budget", "24",
                        "--harness", tiny_harness, "--proposer", "openai", "--proposer-url", url, timeout=600)
    finally:
        server.shutdown()
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert sorted(arch) == ["cand_000", "cand_001"] and arch["cand_001"]["meta"]["format"] == "edit"
    assert arch["cand_001"]["scores"] and arch["cand_001"]["meta"]["parent"] == "cand_000"
    assert any("500" in e for e in its[1]["proposer_errors"]) and its[-1]["stop_reason"].startswith("switch policy")
    assert s["steps"] == 2 and s["cycles"] == 1 and s["proposer_calls"] == 2  # weight training went on after it
    assert [e["event"] for e in events].count("harness_phase_end") == 1


CLAUDE = "claude -p --output-format json --permission-mode acceptEdits --allowedTools Read,Write,Edit,Glob,Grep"


CODEX = "codex exec --json --skip-git-repo-check --sandbox workspace-write -"


@pytest.mark.slow
def test_harness_only_run_with_claude_like_agent(tmp_path, tiny_harness):
    """The README's Claude Code command line, run against a stand-in: one valid file; the same call
    edits the scores of its archive copy, plants a symlink candidate and writes outside new/
    (all reported, none trusted); then it writes nothing three times and the phase ends."""
    usage = {"input": 1000, "cached": 500, "output": 200}
    plan = [{"derive": {"new/cand_1.py": ["Ask for the exact words of the passage.", "\nPROPOSED_BY = 'claude'\n"]},
             "edit_json": {"cand_000/scores.json": {"success": 1.0}}, "symlink": {"new/cand_2.py": "/etc/hostname"},
             "write": {"notes.txt": "my notes"}, "cost_usd": 0.0123, "usage": usage}] + \
        [{"cost_usd": 0.001, "usage": usage}] * 3
    env = agent_bin(tmp_path, plan)
    out = tmp_path / "run"
    res = run_whale("--domain", "searchqa", "--method", "harness-only", "--out", str(out), *E2E,
                    "--harness", tiny_harness, "--proposer", "command", "--proposer-command", CLAUDE,
                    "--proposer-timeout", "120", "--proposer-env", "FAKE_AGENT_PLAN", env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert sorted(arch) == ["cand_000", "cand_001"] and arch["cand_001"]["scores"]
    assert arch["cand_001"]["meta"]["note"] == "Ask for the exact words of the passage."
    assert arch["cand_001"]["meta"]["parent"] == "cand_000"
    for c in arch.values():  # the scores selection read are the ones its own traces give, not the agent's edit
        real = harness_archive.score_records(harness_archive.read_traces(c), c["scores"]["example_ids"])
        assert (c["scores"]["success"], c["scores"]["per_example"]) == (real["success"], real["per_example"])
    assert its[1]["paper_success"] == max(c["scores"]["success"] for c in arch.values())
    errors = " | ".join(its[1]["proposer_errors"])
    assert "outside new/" in errors and "cand_000/scores.json" in errors
    assert ("a symbolic link" in errors) != (isolation.plan()["landlock_abi"] > 0)  # jailed: no link was made at all
    assert len(its) == 5 and its[-1]["stop_reason"] == "3 iterations in a row without a valid candidate"
    assert s["proposer_calls"] == 4 and abs(s["proposer_cost_usd"] - 0.0153) < 1e-9
    assert (s["proposer_prompt_tokens"], s["proposer_completion_tokens"]) == (4 * 1500, 4 * 200)
    calls = [json.loads(x) for x in (out / "archive" / "phase00" / "proposer_calls.jsonl").read_text().splitlines()]
    assert [c["files"] for c in calls] == [["cand_1.py"], [], [], []] and calls[0]["usage"]["cost_usd"] == 0.0123


@pytest.mark.slow
def test_whale_run_with_codex_like_agent(tmp_path, tiny_harness):
    plan = [{"derive": {"new/cand_1.py": ["Quote the passage's words.\n\nParent: cand_000", "\nPROPOSED_BY = 'codex'\n"]},
             "write": {"new/cand_2.py": '"""No entry point."""\nX = 1\n'},
             "usage": {"input": 500, "cached": 1500, "output": 300}}]
    env = agent_bin(tmp_path, plan)
    out = tmp_path / "run"
    res = run_whale("--domain", "searchqa", "--method", "whale", "--out", str(out), *E2E, "--budget", "24",
                    "--harness", tiny_harness, "--proposer", "command", "--proposer-command", CODEX,
                    "--proposer-env", "FAKE_AGENT_PLAN", env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert arch["cand_001"]["scores"] and arch["cand_001"]["meta"]["parent"] == "cand_000"
    assert arch["cand_002"]["invalid"].startswith("no top-level function run")
    assert (s["proposer_calls"], s["proposer_prompt_tokens"], s["proposer_completion_tokens"]) == (1, 2000, 300)
    assert s["proposer_cost_usd"] == 0 and s["steps"] == 2 and its[-1]["stop_reason"].startswith("switch policy")
    assert '"type": "turn.completed"' in (out / "archive" / "phase00" / "PROPOSE.log").read_text()


@pytest.mark.slow
def test_proposer_budget_usd_ends_the_search_and_counts_what_a_resumed_run_spent(tmp_path, tiny_harness):
    """A Claude-like agent that reports $0.01 per call and always writes a new valid file, with
    --proposer-budget-usd 0.025: the search ends after the third call with that reason. Killed in
    the middle of the second iteration and resumed, the run still makes three calls in all (the
    resumed process counts the dollars the archive records), not three more."""
    plan = [{"derive": {"new/cand_1.py": [f"Variant {i}.", f"\nVARIANT = {i}\n"]}, "cost_usd": 0.01} for i in range(9)]
    env = agent_bin(tmp_path, plan)
    out = tmp_path / "run"
    args = ("--domain", "searchqa", "--method", "harness-only", "--out", str(out), *E2E, "--harness", tiny_harness,
            "--proposer", "command", "--proposer-command", CLAUDE, "--proposer-env", "FAKE_AGENT_PLAN",
            "--proposer-budget-usd", "0.025", "--candidates", "1")
    crashed = run_whale(*args, env={**env, "WHALE_CRASH_AT": "harness_eval:3"}, timeout=600)  # in iteration 2
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    res = run_whale("--resume", str(out), env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert its[-1]["stop_reason"] == "proposer budget: $0.0300 of --proposer-budget-usd 0.025 spent"
    assert len(its) == 4 and sorted(arch) == ["cand_000", "cand_001", "cand_002", "cand_003"]
    assert s["proposer_calls"] == 3 and abs(s["proposer_cost_usd"] - 0.03) < 1e-9


@pytest.mark.slow
def test_stand_ins_refuse_what_the_real_clis_refuse(tmp_path):
    """The recipes' flags matter: without --skip-git-repo-check codex exec refuses a directory that
    is not a git repository; without a write permission mode claude -p writes nothing."""
    env = {**os.environ, **agent_bin(tmp_path, [{"write": {"new/cand_1.py": "x"}}] * 3)}
    (tmp_path / "w" / "new").mkdir(parents=True)
    (tmp_path / "w" / "cand_000").mkdir()
    (tmp_path / "w" / "cand_000" / "harness.py").write_text("")
    prompt = "## Task\nwrite new/cand_1.py"
    run = lambda cmd: subprocess.run(cmd, shell=True, cwd=tmp_path / "w", input=prompt, capture_output=True,  # noqa: E731
                                     text=True, env=env, timeout=60)
    assert "skip-git-repo-check" in run("codex exec --json -").stderr
    r = run("claude -p --output-format json")
    assert json.loads(r.stdout)["permission_denials"] and not (tmp_path / "w" / "new" / "cand_1.py").exists()
    assert run("claude -p --output-format yaml").returncode == 2  # an unknown value is an error, as in the CLI
