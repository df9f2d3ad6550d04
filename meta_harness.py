"""meta_harness.py: phase B of WHALE, a Meta-Harness search over harness source files.

One harness phase = one search = one archive directory on disk:
  iteration 0   evaluate the incoming harness as cand_000 (it is the incumbent);
  iteration i   a proposer reads the archive and writes k new harness files; each one is
                validated (valid Unicode, parses, defines run(task, llm, tools), imports only
                the standard library, is not a repeat of an archived source, [prompt-only:
                differs from the base only in the domain's PROMPT_AXES], runs ONE task in the
                sandbox),
                then evaluated once per example of D_harness, or raced (race=RACE: scored in blocks
                against the incumbent and dropped at a look once it has little chance left; see RACE);
                the k are scored at once where run_together shares their batches (whale.py does).
                Valid or not, all is archived, in the candidates' order.
  selection     the paper takes the archive argmax of (success desc, mean turns asc): the
                paper's choice, the archive's top scorer, which proposers edit. We log
                that choice every iteration, but the incumbent is replaced only when a
                one-sided paired sign test on the same examples says the gain is beyond noise
                (see `accept`). A near miss of that test (more wins than losses, alpha < p <=
                CONFIRM_P) gets a second look: both are scored on a confirmation block of
                examples the search never used, and the test is redone on both blocks
                (`confirm_examples`; each candidate is measured there once). The phase
                returns the incumbent.
  stopping      after every iteration, the first of: the proposer says it has nothing left
                (the primitives menu is exhausted on the paper's choice) -> the phase ends at once;
                EMPTY_ITERATIONS_TO_STOP iterations in a row without a valid candidate (the
                proposer returned nothing, only invalid candidates, or failed) -> it ends; or
                should_stop(paper_successes) (the budget, the switch policy); paper_successes[i] =
                the success of the paper's choice (the archive's top scorer) after iteration i (the
                `paper_success` field of iterations.jsonl; switch.py's harness_done takes exactly that).
                The reason is logged and written into the last iterations.jsonl line and the
                phase result. An empty iteration spends no rollouts, so without the first two
                rules a proposer that never produces a valid candidate would loop forever.
                After a proposer call that proposed nothing (an error, a down endpoint) the next
                call waits, doubling from backoff[0] up to backoff[1] seconds.

The archive (cand_NNN/ with harness.py, meta.json, scores.json, traces.jsonl; summary.jsonl,
iterations.jsonl, ...) is everything a proposer may read: harness-split traces, never the reference
answers or the test split. Beside it, the parent's ledger: every score measured and incumbent
chosen, which is all selection trusts. Their layout and readers: harness_search/harness_archive.py.

Resuming: call search_phase again on the same archive_dir. Finished candidates (scores.json or
invalid.txt) are reused, candidates proposed but not finished are finished without asking the
proposer again, the paper scores and incumbent come from iterations.jsonl, and the counters are the
sum of the costs recorded in summary.jsonl + iterations.jsonl (so they count finished work).
A resumed search first replays the events of the finished work into `log` (marked
replayed=True), so a log that was cut back to a checkpoint still holds one line per event.

Proposers live in harness_search/ (one interface: propose(archive_dir, k) -> Proposal(candidates,
errors, exhausted, usage), or just the list of candidates); search_phase only calls the one it is given.

Events (to `log`, one dict each): harness_candidate (scored or invalid, with the reason),
proposer_error, proposer_backoff, archive_integrity, harness_iteration, harness_phase_end
(with the reason).

Reading harness source (names, splice, duplicates, the static check) is harness_search/harness_source.py.
What it leaves out: running harness code (jail/sandbox.py, behind the run_candidate/validate_run
callables the lead passes in), the model (lm/engine.py), when to switch (switch.py), parallel
proposer calls, the proposers themselves (harness_search/proposers.py). Selection reads only the ledger this
module writes; the command proposer's coding agent works in a copy of the archive, never in
this directory (harness_search/agent_proposer.py says how that is enforced and checked).
"""

import json
import math
import os
import threading
import time

from harness_search.harness_archive import (  # the files: candidates, lines, the ledger, a search opened or resumed
    append_jsonl, cand_name, candidate_event, drop_token_ids, iteration_event, ledger_path_for, load_archive,
    open_search, paper_choice, read_jsonl, read_ledger, score_records, sum_costs, summary_line, trusted_archive,
    write_candidate, write_frontier, write_json)
from harness_search.harness_source import differs_only_in, normalized, static_check  # the source, as text
from harness_search.proposal import Proposal  # what a proposer call returns
from jail.sandbox import valid_text  # the one text rule (lone surrogates), at every boundary

EMPTY_ITERATIONS_TO_STOP = 3  # consecutive iterations without a valid candidate end a phase
BACKOFF = (1.0, 60.0)         # seconds before the next call after a failed proposer call: first, cap

# -----------------------------------------------------------------------------
# Acceptance: a paired test on the same examples


def sign_test(cand_scores, inc_scores):
    """Exact one-sided sign test (McNemar's exact test) on paired per-example scores.
    b = examples the candidate does better on, c = the incumbent does better on; ties carry no
    information. Under "no difference" each discordant pair is a fair coin, so
    p = P(Binom(b + c, 1/2) >= b)."""
    pairs = [(float(x), float(y)) for x, y in zip(cand_scores, inc_scores)]  # plain floats, not numpy
    b = sum(x > y for x, y in pairs)
    c = sum(x < y for x, y in pairs)
    n = b + c
    p = sum(math.comb(n, j) for j in range(b, n + 1)) / 2 ** n if n else 1.0
    return b, c, p


# The second look (search_phase's confirm_examples): a candidate that wins more examples than it
# loses but misses alpha with p <= CONFIRM_P is scored with the incumbent on a block of examples
# the search never used, and the test is redone on both blocks together. Why: a top candidate that
# narrowly fails the test stays the archive's top and is tested again every iteration on the same
# examples with the same result, so a real but small gain (e.g. 6 wins to 3 on 64 examples,
# p = 0.25) blocks the search for good. Looking twice lets an equal candidate in somewhat more
# often than alpha; a worse one still has to win both blocks together.
CONFIRM_P = 0.5


def accept(cand_scores, inc_scores, alpha=0.1):
    """(accepted, b, c, p). Why not the paper's plain argmax: every candidate is scored with
    one or two rollouts per example, so with 3 candidates per iteration the argmax is often a lucky
    draw of a harness no better than the incumbent. The candidate must win the discordant
    pairs and the exact test must reject "no better" at level alpha. Pairing on the same
    examples removes the example-difficulty variance an unpaired comparison would carry.
    Only the single best candidate is tested per iteration, but it is the max of several, so
    an equal candidate gets in somewhat more often than alpha; that costs nothing in
    expectation, while a worse one stays out."""
    b, c, p = sign_test(cand_scores, inc_scores)
    return (b > c and p <= alpha), b, c, p


# Racing (issue 67; `search_phase(race=RACE)`, whale.py's --race; results/racing/README.md replays it on
# every committed search): a candidate is scored in blocks of examples, paired with the incumbent on the
# same examples (the incumbent's scores are its full evaluation's, never re-run), and after each block
# but the last it is dropped when it has little chance left to be accepted. There is no early accept: a
# candidate that is not dropped is scored on every example and decided by accept() as without racing,
# so racing saves rollouts on losers and never lets one in; its one error is dropping a candidate the
# full evaluation would have accepted. A dropped candidate is archived with its partial scores and
# `dropped_after` (examples scored), and is never the paper's choice (its score is over fewer examples).
# Rule "futility": the chance that accept() says yes at the end, with the examples still to come
# drawn as the ones so far (each discordant with the rate seen, and won by the candidate with the
# share seen; both with one pseudo-count either way), below gamma: drop. Why not a plain SPRT on
# the discordant pairs (rule "sprt", kept for the replay): on a 64-example search set most examples
# are ties, so few discordant pairs come and the SPRT rarely decides; the futility rule also reads
# "few discordant pairs so far" as "too few to be accepted", which is what makes a loser a loser here.
# stages: where it looks, as shares of the search set (or example counts), instead of every `block`
# examples: fewer, larger blocks, because on a CPU a thin batch runs the model far below its speed
# (`python tools/bench.py --only race` prices each cut). The setting is the replay's (the rule for
# choosing it, and the grid: results/racing/README.md): looks after a quarter, a half and three quarters.
RACE = dict(rule="futility", block=8, gamma=0.01, stages=(0.25, 0.5, 0.75))


def _sign_p(b, c):
    """The sign test's p for b wins and c losses (sign_test on counts)."""
    n = b + c
    return sum(math.comb(n, j) for j in range(b, n + 1)) / 2 ** n if n else 1.0


def chance_to_accept(b, c, seen, left, alpha):
    """P(accept() at the end) after `seen` paired examples (b wins, c losses) with `left` to come,
    each discordant with chance (b + c + 1) / (seen + 2) and then won with chance (b + 1) / (b + c + 2)."""
    d, w = (b + c + 1) / (seen + 2), (b + 1) / (b + c + 2)
    total = 0.0
    for k in range(left + 1):  # k more discordant examples, j of them won
        p_k = math.comb(left, k) * d ** k * (1 - d) ** (left - k)
        for j in range(k + 1):
            if b + j > c + k - j and _sign_p(b + j, c + k - j) <= alpha:
                total += p_k * math.comb(k, j) * w ** j * (1 - w) ** (k - j)
    return total


def race_looks(n, block=8, stages=None, **_):
    """The example counts after which a race of n examples looks (the last block always runs): every
    `block`, or at `stages` (a share of n where it is under 1, else a count) where no block is thinner
    than `block` examples (a tiny search set is not raced)."""
    if not stages:
        return list(range(block, n, block))
    looks, last = [], 0
    for k in sorted({round(x * n) if x < 1 else int(x) for x in stages}):
        if k - last >= block and n - k >= block:
            looks, last = looks + [k], k
    return looks


def drop_now(cand_so_far, inc_so_far, n, alpha=0.1, rule="futility", gamma=0.005, beta=0.05, theta1=0.75, **_):
    """After a look at the first len(cand_so_far) of n paired examples: drop the candidate? rule
    "futility": chance_to_accept < gamma; rule "sprt": Wald's SPRT of theta = 1/2 against theta1 (the
    candidate's share of the discordant pairs), dropped once b log(2 theta1) + c log(2 (1 - theta1))
    <= log(beta / (1 - alpha))."""
    seen = len(cand_so_far)
    b, c, _ = sign_test(cand_so_far, inc_so_far[:seen])
    if rule == "futility":
        return chance_to_accept(b, c, seen, n - seen, alpha) < gamma
    return b * math.log(2 * theta1) + c * math.log(2 * (1 - theta1)) <= math.log(beta / (1 - alpha))


def race(cand_scores, inc_scores, alpha=0.1, **rule):
    """(dropped, examples used) of a candidate whose scores on every example are known, raced
    against the incumbent with `rule` (RACE's keys): what search_phase would have spent on it."""
    n = len(cand_scores)
    for end in race_looks(n, **rule):
        if drop_now(cand_scores[:end], inc_scores, n, alpha, **rule):
            return True, end
    return False, n


# -----------------------------------------------------------------------------
# The search


def spent_rollouts(archive_dir):
    """Rollouts the finished candidates of this archive cost (what a budget rule needs)."""
    return sum_costs(archive_dir).get("rollouts", 0)


def spent_usd(archive_dir):
    """Dollars the proposer reported for this archive (a proposer budget needs it): the finished
    iterations', and the proposal of the one not yet recorded (its candidates carry its cost)."""
    done = {line.get("iteration") for line in read_jsonl(os.path.join(archive_dir, "iterations.jsonl"))}
    pending = {c["meta"].get("iteration"): (c["meta"].get("proposal_cost") or {}).get("proposer_cost_usd", 0.0)
               for c in load_archive(archive_dir) if c["meta"].get("iteration") not in done}
    return sum_costs(archive_dir).get("proposer_cost_usd", 0.0) + sum(pending.values())


def candidate_rollouts(archive_dir, cand):
    """Rollouts one finished candidate of this archive cost (0: rejected before its evaluation)."""
    line = next((x for x in read_jsonl(os.path.join(archive_dir, "summary.jsonl")) if x.get("cand") == cand), {})
    return (line.get("cost") or {}).get("rollouts", 0)


def paid(records):
    """The rollouts of these records the budget pays for: all but those an evaluation cache gave back
    from earlier work (marked "cached", harness_search/eval_cache.py)."""
    return sum(not r.get("cached") for r in records)


def read_confirmations(ledger_path):
    """{cand: ledger line} of the candidates scored on the confirmation block: confirm (the
    scores), iteration (when), rollouts (what it cost)."""
    return {line["cand"]: line for line in read_jsonl(ledger_path) if "confirm" in line}


def _confirm_scores(cands, examples, run_candidate, ledger_path, iteration, affordable):
    """Each candidate's scores on the confirmation examples, measured once per candidate (the
    ledger keeps them, so a later test or a resumed search reuses them); None when the budget
    cannot pay for the ones not measured yet (each costs at most one candidate's evaluation).
    One after the other, not in shared batches: a whole block is a batch of 64 rows already, and
    run 22 of results/first-run/ measured the pair shared slower (97 s against run 18's 84.5 s):
    each waits for the other's longest reply in every batch."""
    done = read_confirmations(ledger_path)
    todo = [c for c in cands if c["name"] not in done]
    if todo and affordable is not None and affordable() < len(todo):
        return None
    for c in todo:
        records = run_candidate(c["source"], examples, c["name"])
        line = dict(cand=c["name"], iteration=iteration, rollouts=paid(records),
                    confirm=score_records(records, [str(ex["id"]) for ex in examples]))
        append_jsonl(ledger_path, line)
        done[c["name"]] = line
    return [done[c["name"]]["confirm"] for c in cands]


def scored_in_race(source, name, examples, run_candidate, race_against=None):
    """(records, dropped_after) of one candidate: scored on every example at once (race_against None),
    or raced block by block against the incumbent (race_against = (the incumbent's per-example scores,
    alpha, rule)): after each look (race_looks) the candidate is dropped if drop_now says so, and then
    dropped_after is the number of examples it was scored on; else it is None."""
    if race_against is None:
        return run_candidate(source, examples, name), None
    inc, alpha, rule = race_against
    ids, n, records, start = [str(ex["id"]) for ex in examples], len(examples), [], 0
    for end in race_looks(n, **rule) + [n]:
        records += run_candidate(source, examples[start:end], name)
        start = end
        if end < n and drop_now(score_records(records, ids[:end])["per_example"], inc, n, alpha, **rule):
            return records, end
    return records, None


def _invalid_reason(c, archive, prompt_only_base, allowed):
    """Why a proposed candidate is not scored, read from its source (None: it may be, once its one
    validation rollout runs): the static check, a duplicate, a prompt-only search's rule. The
    incoming harness (cand_000) is scored whatever it is: it is the incumbent."""
    if c["num"] == 0:
        return None
    src = c["source"]
    reason = c["meta"].get("reject") or static_check(src)
    if reason is None:
        norm = normalized(src)
        dup = [o["name"] for o in archive if o["num"] < c["num"] and normalized(o["source"]) == norm]
        reason = f"duplicate of {dup[0]}" if dup else None
    if reason is None and prompt_only_base is not None:
        ok, why = differs_only_in(prompt_only_base, src, allowed)
        reason = None if ok else f"prompt-only search: {why}"
    return reason


def _validation(validate_run, source):
    """A job for run_together: (why its one rollout says the candidate is invalid or None, seconds)."""
    def job():
        t = time.time()
        try:
            reason = validate_run(source)
        except Exception as e:  # a validator failure rejects the candidate, not the run
            reason = f"validate_run raised {type(e).__name__}: {e}"
        return reason, time.time() - t
    return job


def _write_invalid(c, archive_dir, reason, log):
    with open(os.path.join(c["dir"], "invalid.txt"), "w") as f:
        f.write(reason.strip() + "\n")
    c["invalid"] = reason
    line = summary_line(c)
    append_jsonl(os.path.join(archive_dir, "summary.jsonl"), line)
    log(candidate_event(line))


def _write_scored(c, archive_dir, ids, records, dropped_after, validate_s, eval_s, ledger_path, log):
    """A scored candidate's files: its traces, scores (the ledger first) and summary line."""
    with open(os.path.join(c["dir"], "traces.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(drop_token_ids(r), default=str) + "\n")
    s = score_records(records, ids[:dropped_after or len(ids)])
    if dropped_after:
        s.update(dropped_after=dropped_after)
    m = c["meta"]
    s.update(cand=c["name"], iteration=m.get("iteration"), proposer=m.get("proposer"),
             parent=m.get("parent"), axis=m.get("axis"), note=m.get("note"),
             cost=dict(candidates=int(c["num"] > 0), evaluated=1, rollouts=paid(records),  # (cand_000: not proposed)
                       **({"cached_rollouts": len(records) - paid(records)} if len(records) > paid(records) else {}),
                       rollout_tokens=sum(int(r.get("tokens") or 0) for r in records if not r.get("cached")),
                       validate_seconds=round(validate_s, 3), eval_seconds=round(eval_s, 3)))
    append_jsonl(ledger_path, dict(cand=c["name"], scores=json.loads(json.dumps(s, default=str))))  # first
    write_json(os.path.join(c["dir"], "scores.json"), s)
    c["scores"] = s
    line = summary_line(c)
    append_jsonl(os.path.join(archive_dir, "summary.jsonl"), line)
    write_frontier(archive_dir)
    log(candidate_event(line))


def in_order():
    """(commit, fail) for jobs that may finish in any order but must write in theirs: commit(i, write)
    runs write() once the writes of jobs 0..i-1 have run, in their order, and never waits (a job
    that finishes early parks its write; whichever job completes the one before runs it: a job that
    waited for its turn would stall batches shared with the others). After fail(), no parked or
    later write runs (resumed, those jobs run again)."""
    lock, parked, turn, broken = threading.Lock(), {}, [0], []

    def commit(i, write):
        with lock:
            parked[i] = write
            while turn[0] in parked and not broken:
                parked.pop(turn[0])()
                turn[0] += 1

    def fail():
        with lock:
            broken.append(True)
    return commit, fail


def finish_candidates(todo, archive_dir, archive, examples, run_candidate, validate_run, prompt_only_base,
                      allowed, log, ledger_path, race_against, run_together):
    """Validate, then score (or reject) an iteration's unfinished candidates, and write their files.
    Their validation rollouts are jobs for run_together (which may run them at once, their batches
    shared: rollout.in_shared_batches); then so is each valid candidate: score it, raced against the
    incumbent if race_against is given (see scored_in_race; never cand_000, the incumbent itself),
    then write its files as soon as the candidates before it have written theirs. So the archive reads the same
    however their rollouts were batched, and a crash loses no candidate that was written.
    Exceptions from run_candidate propagate: they mean the infrastructure broke (a broken harness
    comes back as records with status error/crash/timeout). The archive stays resumable."""
    ids = [str(ex["id"]) for ex in examples]
    reasons = [_invalid_reason(c, archive, prompt_only_base, allowed) for c in todo]
    check = [i for i, c in enumerate(todo) if reasons[i] is None and c["num"] > 0]  # (cand_000 runs whatever it is)
    validated, validate_s = run_together([_validation(validate_run, todo[i]["source"]) for i in check]), [0.0] * len(todo)
    for i, (reason, seconds) in zip(check, validated):
        reasons[i], validate_s[i] = reason, seconds
    reasons = [None if r is None else valid_text(str(r), replace=True) for r in reasons]  # (a harness's own words)
    commit, fail = in_order()

    def job(i, c):
        def score_then_write():
            if reasons[i] is not None:
                return commit(i, lambda: _write_invalid(c, archive_dir, reasons[i], log))
            try:
                t = time.time()
                records, dropped_after = scored_in_race(c["source"], c["name"], examples, run_candidate,
                                                        race_against if c["num"] > 0 else None)
            except BaseException:
                fail()  # the candidates after it write nothing (resumed, they are scored)
                raise
            eval_s = time.time() - t
            commit(i, lambda: _write_scored(c, archive_dir, ids, records, dropped_after, validate_s[i], eval_s,
                                            ledger_path, log))
        return score_then_write

    run_together([job(i, c) for i, c in enumerate(todo)])


def console_line(event, cycle):
    """The console's short line (<= ~120 characters) for one of this search's events; None: print the
    event's fields (metrics.jsonl keeps every event whole)."""
    e, where = event.get("event"), f"B{cycle}"
    if e == "harness_candidate":
        what = " ".join(str(x) for x in (event.get("kind"), event.get("axis")) if x)[:48] or "the incoming harness"
        if event.get("status") != "ok":
            return f"{where} {event.get('cand')} {what}: invalid: {str(event.get('reason'))[:60]}"
        dropped = f", dropped after {event['dropped_after']} examples" if event.get("dropped_after") else ""
        return f"{where} {event.get('cand')} {what}: {100 * event.get('success', 0):.1f} %{dropped}"
    if e == "harness_iteration":
        test = event.get("test") or {}
        verdict = (f"accepted {event['incumbent']}" if event.get("accepted") else f"incumbent {event.get('incumbent')}"
                   f"{' (' + test['cand'] + ' not accepted, p ' + format(test['p'], '.2f') + ')' if test else ''}")
        return (f"{where} iteration {event.get('iteration')}: {event.get('valid', 0)} scored, best "
                f"{event.get('paper_choice')} {100 * (event.get('paper_success') or 0):.1f} %; {verdict}")
    if e == "harness_phase_end":
        return f"{where} ends after iteration {event.get('iterations', 1) - 1}: {str(event.get('reason'))[:80]}"
    if e in ("proposer_error", "archive_integrity"):
        return f"{where} {e.replace('_', ' ')}: {str(event.get('reason'))[:90]}"
    if e == "proposer_backoff":
        return f"{where} the proposer failed {event.get('failed_calls')} calls: waiting {event.get('seconds')} s"
    return None


PROPOSER_COST_KEYS = ("calls", "prompt_chars", "completion_chars", "prompt_tokens", "completion_tokens", "cost_usd")


def _propose(propose, archive_dir, k, log):
    """Ask the proposer; never let it crash the run. Returns (candidates, cost, errors, exhausted)."""
    t0 = time.time()
    try:
        out = propose(archive_dir, k)
        if not isinstance(out, Proposal):  # a plain function: its list of candidates (one call)
            out = Proposal(list(out or []))
    except Exception as e:
        out = Proposal([], [f"proposer raised {type(e).__name__}: {e}"])
    cands = list(out.candidates or [])[:k]
    # (an agent's own words, e.g. from its JSON output, go to the console and iterations.jsonl)
    errors = [valid_text(str(e), replace=True) for e in out.errors or []]
    cost = {f"proposer_{key}": (out.usage or {}).get(key, 0) for key in PROPOSER_COST_KEYS}
    cost["proposer_calls"] = cost["proposer_calls"] or 1
    cost["proposer_seconds"] = round(time.time() - t0, 3)
    cost["proposer_cost_usd"] = round(cost["proposer_cost_usd"], 6)
    cands = [c if isinstance(c, dict) else {"source": c if isinstance(c, str) else ""} for c in cands]
    if not cands and not errors:
        errors = ["the proposer returned no candidates"]
    for e in errors:
        log(dict(event="proposer_error", reason=str(e)[:500]))
    # Only "nothing at all on this archive" counts as exhausted: the next call sees the same
    # archive, so it would return nothing again (primitives is deterministic given the archive).
    return cands, cost, errors, bool(out.exhausted) and not cands


def _valid_count(line):
    # lines written before `valid` was recorded: iteration_best is None when nothing scored
    return line.get("valid", 0 if line.get("iteration_best") is None else 1)


def _trailing(iters, pred):
    n = 0
    for line in reversed(iters):
        if line.get("iteration") == 0 or not pred(line):
            break
        n += 1
    return n


def stop_reason(iters, should_stop, max_empty=EMPTY_ITERATIONS_TO_STOP):
    """Why the phase ends after these iterations (a short sentence), or None to go on. Worked out
    from the lines each time (a recorded stop_reason is for readers), so a search continued
    with a more generous should_stop goes on."""
    if not iters:
        return None  # iteration 0 (the incoming harness) always runs
    if iters[-1].get("proposer_exhausted"):
        return "the proposer has nothing new to propose on the current best (menu exhausted)"
    empty = _trailing(iters, lambda line: _valid_count(line) == 0)
    if empty >= max_empty:
        return f"{empty} iterations in a row without a valid candidate"
    verdict = should_stop([line["paper_success"] for line in iters])
    if verdict:
        return verdict if isinstance(verdict, str) else "should_stop said so (budget or switch policy)"
    return None


def incumbent_after(ledger_path, it, default=None):
    """The incumbent the search chose after iteration `it`, as its ledger says (before iteration 0, and
    where the ledger has no line for `it`: `default`, else the incoming harness cand_000)."""
    return read_ledger(ledger_path)[1].get(it, default or cand_name(0)) if it >= 0 else cand_name(0)


def select_incumbent(it, members, archive, incumbent, proposal, integrity, *, accept_alpha, confirm_examples,
                     run_candidate, ledger_path, affordable) -> dict:
    """The acceptance step after iteration `it`, as its iterations.jsonl line: the paper's choice (the argmax
    over the whole phase archive), the paired sign test of it against the incumbent (with a second
    look on a near miss), the new incumbent, and what the proposer reported (`proposal`)."""
    scored = [c for c in archive if c["scores"]]
    by_name = {c["name"]: c for c in scored}
    paper = paper_choice(scored)
    inc = by_name[incumbent]
    test, accepted = None, False
    if paper["name"] != incumbent:
        accepted, b, c_, p = accept(paper["scores"]["per_example"], inc["scores"]["per_example"], accept_alpha)
        test = dict(cand=paper["name"], vs=incumbent, b=b, c=c_, p=round(p, 6), alpha=accept_alpha)
        if confirm_examples and not accepted and b > c_ and p <= CONFIRM_P:  # a near miss
            more = _confirm_scores([paper, inc], confirm_examples, run_candidate, ledger_path, it, affordable)
            if more is not None:  # the second look: the test again on both blocks together
                accepted, b, c_, p = accept(paper["scores"]["per_example"] + more[0]["per_example"],
                                            inc["scores"]["per_example"] + more[1]["per_example"], accept_alpha)
                test["confirm"] = dict(examples=len(confirm_examples), b=b, c=c_, p=round(p, 6))
    confirm_rollouts = sum(x["rollouts"] for x in read_confirmations(ledger_path).values() if x["iteration"] == it)
    new_inc = paper["name"] if accepted else incumbent
    it_scores = [c["scores"]["success"] for c in members if c["scores"]]
    line = dict(iteration=it, cands=[c["name"] for c in members], valid=len(it_scores),
                iteration_best=max(it_scores) if it_scores else None,
                paper_choice=paper["name"], paper_success=paper["scores"]["success"],  # (switch.py reads it)
                paper_mean_turns=paper["scores"]["mean_turns"],
                test=test, accepted=accepted, incumbent=new_inc,
                incumbent_success=by_name[new_inc]["scores"]["success"],
                proposer_errors=[str(e)[:300] for e in proposal["errors"]],
                proposer_failed=proposal["failed"], proposer_exhausted=proposal["exhausted"], integrity=integrity,
                cost=dict(proposal["cost"], iterations=1, accepted=int(accepted)))
    if confirm_rollouts:  # (the second look's evaluations, booked with the iteration that made them)
        line.update(confirm_rollouts=confirm_rollouts)
        line["cost"]["rollouts"] = confirm_rollouts
    return line


def search_phase(incumbent_src, domain, examples, run_candidate, validate_run, propose, *, archive_dir,
                 k=3, should_stop, affordable=None, prompt_only_base=None, accept_alpha=0.1, log=print,
                 max_empty=EMPTY_ITERATIONS_TO_STOP, backoff=BACKOFF, ledger_path=None, confirm_examples=(),
                 race=None, run_together=lambda jobs: [job() for job in jobs]):
    """Run (or resume) one Meta-Harness search. Returns dict(incumbent_source, incumbent_scores,
    iterations, counters, paper_successes, incumbent, paper_choice, stop_reason).

    Three candidates have names here: the incumbent (what the sign test kept; the phase returns
    it), the paper's choice (the archive's top scorer, paper_choice(); its success after each
    iteration is `paper_successes`, logged as paper_success) and a candidate's parent (what its proposer
    edited: the paper's choice when it proposed).

    run_candidate(source, examples, name) -> rollout records (name = the candidate's;
    seeding by example rather than by name gives every candidate the same random numbers,
    which makes the paired test sharper). validate_run(source) -> reason or None.
    should_stop(paper_successes) is asked after every iteration, iteration 0 included; it may return
    a string, which becomes the recorded stop reason. affordable() -> how many candidates the
    budget still pays for (None: always k): an iteration proposes min(k, affordable()), so the
    last one of a phase can be smaller and a run spends its whole budget. log(event dict) gets
    every event. ledger_path: the parent's record of the scores it measured and the incumbents
    it chose (default: beside archive_dir, <archive_dir>.ledger.jsonl); selection reads only it.
    confirm_examples: the second look's block (see CONFIRM_P; empty: none), scored with run_candidate
    and paid from the same budget (affordable()); its rollouts are in the iteration's cost.
    race: None scores every candidate on every example (the paper's way); a dict like RACE races each
    proposed candidate against the incumbent block by block (see RACE): a dropped candidate stops
    spending, and the rest are decided by accept() on every example as without racing.
    run_together(jobs) -> their results: how an iteration's candidates are scored (default: one after
    another; whale.py shares their batches, rollout.in_shared_batches)."""
    ids = [str(ex["id"]) for ex in examples]
    allowed = sorted(domain.PROMPT_AXES) if prompt_only_base is not None else None
    ledger_path = ledger_path or ledger_path_for(archive_dir)
    iters_path = open_search(archive_dir, incumbent_src, ids, allowed, k, ledger_path, log)  # new or resumed

    while True:
        iters = read_jsonl(iters_path)
        reason = stop_reason(iters, should_stop, max_empty)
        if reason:
            break
        it = len(iters)
        # What the files say is checked against what this search measured and chose (the ledger):
        # between iterations (a process the agent left behind), and again after the proposer ran.
        archive, integrity = trusted_archive(archive_dir, ledger_path)
        incumbent = incumbent_after(ledger_path, it - 1)
        if iters and iters[-1]["incumbent"] != incumbent:
            integrity.append(f"iterations.jsonl names {iters[-1]['incumbent']} the incumbent, the search chose "
                             f"{incumbent}; refused")
        members = [c for c in archive if c["meta"].get("iteration") == it]
        proposal = dict(errors=[], exhausted=False, failed=False)
        if members:  # proposed before a crash (or cand_000): finish them, don't ask again
            proposal["cost"] = next((c["meta"]["proposal_cost"] for c in members if c["meta"].get("proposal_cost")), {})
        else:
            fails = _trailing(iters, lambda line: line.get("proposer_failed"))
            if fails:  # the last calls failed: wait before asking again (doubling, capped)
                wait = min(backoff[1], backoff[0] * 2 ** (fails - 1))
                log(dict(event="proposer_backoff", seconds=wait, failed_calls=fails))
                time.sleep(wait)
            k_now = k if affordable is None else max(1, min(k, affordable()))  # should_stop ends a phase at 0
            cands, proposal["cost"], proposal["errors"], proposal["exhausted"] = _propose(propose, archive_dir, k_now,
                                                                                          log)
            proposal["failed"] = not cands
            nxt = max([c["num"] for c in archive] + [0]) + 1
            for j, cand in enumerate(cands):
                write_candidate(archive_dir, nxt + j, cand, it, proposal["cost"])
            archive, problems = trusted_archive(archive_dir, ledger_path)
            integrity += problems
            members = [c for c in archive if c["meta"].get("iteration") == it]
        inc_scores = next((x["scores"]["per_example"] for x in archive if x["name"] == incumbent and x["scores"]), None)
        finish_candidates([c for c in members if not (c["scores"] or c["invalid"])], archive_dir, archive, examples,
                          run_candidate, validate_run, prompt_only_base, allowed, log, ledger_path,
                          (inc_scores, accept_alpha, race) if race else None, run_together)
        for p in integrity:
            log(dict(event="archive_integrity", reason=p))
        line = select_incumbent(it, members, archive, incumbent, proposal, integrity, accept_alpha=accept_alpha,
                                confirm_examples=confirm_examples, run_candidate=run_candidate,
                                ledger_path=ledger_path, affordable=affordable)
        # The line that ends the phase says why (should_stop sees this iteration's paper score too).
        line["stop_reason"] = stop_reason(iters + [line], should_stop, max_empty)
        append_jsonl(ledger_path, dict(iteration=it, incumbent=line["incumbent"]))  # the ledger first
        append_jsonl(iters_path, line)
        log(iteration_event(line))

    archive, _ = trusted_archive(archive_dir, ledger_path)
    by_name = {c["name"]: c for c in archive}
    inc = by_name[incumbent_after(ledger_path, len(iters) - 1, iters[-1]["incumbent"])]
    log(dict(event="harness_phase_end", reason=reason, iterations=len(iters), incumbent=inc["name"],
             incumbent_success=inc["scores"]["success"]))
    return dict(incumbent_source=inc["source"], incumbent_scores=inc["scores"], iterations=len(iters),
                counters=sum_costs(archive_dir), paper_successes=[line["paper_success"] for line in iters],
                incumbent=inc["name"],
                paper_choice=iters[-1]["paper_choice"], stop_reason=reason)
