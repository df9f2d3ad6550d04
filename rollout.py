"""
Rollouts: run one harness over examples x n samples, verify, and score mean@k.

This is the one path phase A (training rollouts), phase B (scoring harness
candidates) and evaluation (mean@8 on val/test) all share, so that the three
always mean the same thing by "a rollout":
  harness code runs in the sandbox child (jail/sandbox.py), its llm() calls come
  back to us in batches and are sampled by the engine (lm/engine.py), its tool
  calls run here against the domain's tools, and the domain's verifier scores
  the answer here. The reference answer never leaves this process.

Several harnesses can roll out at once with their model calls batched together
(`in_shared_batches`: phase B scores an iteration's candidates that way).

Left out: asynchronous/streaming rollouts across phases (each call returns when
its rollouts are done) and rollouts on several machines.
"""
import contextlib
import hashlib
import time
import types

import numpy as np

from jail import sandbox
from rundir.run_dir import crash_point

WAVE = 512  # rollouts per sandbox child: bounds threads/memory per child and is the engine's batch
# Longest prompt one llm() call may send, in tokens after the chat template (also never more than
# the model's context minus the completion). Our longest real prompts (chess retries) are ~1,000
# tokens; sandbox.MAX_PROMPT_CHARS alone would let one call through at ~65k tokens, or ~700k with
# 100k tiny messages, and a prefill that size takes gigabytes. Checked before anything is sampled.
MAX_PROMPT_TOKENS = 4096


def stable_seed(*parts) -> int:
    """A 63-bit seed from any printable parts; the same on every machine and run."""
    h = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def run(engine, domain, source: str, examples: list[dict], n: int, *, seed, sampling: dict,
        rollout_timeout: float = 120.0, max_tokens: int = 256, progress=None) -> list[dict]:
    """Roll `source` out n times per example. Returns one record per rollout with
    "example_id", "sample", "score" (0/1) added to the sandbox's record.

    sampling: {"temperature", "top_k", "top_p"} owned by the run, not the harness.
    The seed of sample j of an example depends only on (seed, example id, j), so
    the same evaluation gives the same rollouts whatever else ran before it."""
    jobs = [{"rid": i * n + j, "task": ex["task"], "seed": stable_seed(seed, ex["id"], j)}
            for i, ex in enumerate(examples) for j in range(n)]
    states = {}

    def make_tools_for(rid):
        tools, state = domain.make_tools(examples[rid // n])
        if hasattr(state, "latest_replies"):  # the domain's tools check moves against the model's words
            state.latest_replies = []
        states[rid] = state
        return tools

    llm_batch = tell_states(make_llm_batch(engine, sampling, max_tokens), states)
    records = []
    for w in range(0, len(jobs), WAVE):
        wave = jobs[w:w + WAVE]
        out = sandbox.run_rollouts(source, wave, llm_batch, make_tools_for,
                                   rollout_timeout=rollout_timeout, max_llm_tokens=max_tokens)
        for rec in out:
            rid = rec["rid"]
            ex = examples[rid // n]
            rec["example_id"], rec["sample"] = ex["id"], rid % n
            rec["score"] = score(domain, ex, rec, states.get(rid))
            rec["turns"] = len(rec["calls"])
            rec["prompt_tokens"] = sum(len(c["prompt_ids"]) for c in rec["calls"])
            rec["completion_tokens"] = sum(len(c["completion_ids"]) for c in rec["calls"])
            rec["tokens"] = rec["prompt_tokens"] + rec["completion_tokens"]
            records.append(rec)
        if progress is not None:
            progress.update(len(wave))
    return records


def in_shared_batches(engine, jobs: list) -> list:
    """Run the callables `jobs` (each does rollouts on `engine`: phase B's candidates of one
    iteration) in threads of their own, and sample every batch they ask for in ONE engine.sample:
    the batches meet. Returns their results in order; the first exception is re-raised.

    Why: a raced candidate is scored in blocks of 16 rollouts (race_looks), and a 16-row decode
    runs far below the machine's peak, so three candidates' blocks decoded as one 48-row batch cost
    less than three apart (prefill gains nothing: it is at the peak already). Measured: 1.14x for
    three raced candidates (`tools/bench.py --only race`), ~1.07x of the default run's phase B. What each rollout
    samples does not change: a request's tokens depend on its own seed, not on its batch
    (lm/engine.py, up to float round-off), and each job's sandbox sends the calls it would send
    alone, since a meeting waits for every job still running (a job's part of a batch is exactly
    what its own sandbox gathered). The jobs' rows are concatenated in job order. The cost: a job
    waits for the slowest part of every batch it is in (the batch returns when its longest reply is
    done), so jobs whose batches are big already gain nothing and can lose (results/README.md).

    The model runs in the calling thread only: the jobs' threads run their sandboxes and tools and
    hand their batches over. (Tensors allocated in several threads would leave freed memory in a
    malloc arena per thread: a default run peaked 600 MB higher that way.) A job that raises ends
    the meeting: the others' next engine.sample raises too (their sandboxes close), so Ctrl-C or a
    crash never leaves a thread waiting for a batch that cannot come."""
    if len(jobs) < 2:
        return [job() for job in jobs]
    import threading
    alone, patched = engine.sample, "sample" in vars(engine)
    meet = threading.Condition()
    active, pending, answers, failed = set(range(len(jobs))), {}, {}, []  # failed: the first is the cause
    me = threading.local()
    results = [None] * len(jobs)

    def sample(requests):  # in a job's thread: hand the batch over, wait for its rows
        k = getattr(me, "k", None)
        if k is None:  # (not one of the jobs)
            return alone(requests)
        with meet:
            pending[k] = requests
            meet.notify_all()
            while k not in answers and not failed:
                meet.wait()
            pending.pop(k, None)
            if k not in answers:
                raise RuntimeError("a job sampling in the same batches failed") from failed[0]
            return answers.pop(k)

    def work(k):
        me.k = k
        try:
            results[k] = jobs[k]()
        except BaseException as e:
            with meet:
                failed.append(e)
        finally:
            with meet:
                active.discard(k)
                meet.notify_all()

    def restore():
        if patched:
            engine.sample = alone
        else:
            del engine.sample  # (the instance's own attribute: the class's method shows through again)

    engine.sample = sample
    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(len(jobs))]
    try:
        for t in threads:
            t.start()
        with meet:
            while active and not failed:
                if not (pending and set(pending) == active):
                    meet.wait(0.2)  # (with a timeout: Ctrl-C reaches this thread)
                    continue
                order = sorted(pending)
                outs = alone([r for k in order for r in pending[k]])  # (every job waits: holding meet is free)
                start = 0
                for k in order:
                    answers[k] = outs[start:start + len(pending.pop(k))]
                    start += len(answers[k])
                meet.notify_all()
    except BaseException as e:
        with meet:
            failed.insert(0, e)
            meet.notify_all()
        if not isinstance(e, Exception):  # Ctrl-C: out at once (the threads are daemons)
            restore()
            raise
    for t in threads:  # (after a failure the others leave at their next batch, closing their sandboxes)
        while t.is_alive():
            t.join(0.2)
    restore()
    if failed:
        raise failed[0]
    return results


def runs_at_all(engine, domain, source: str, example: dict, *, seed, sampling: dict, max_tokens: int,
                timeout: float = 60.0) -> str | None:
    """Does a proposed harness run at all? One rollout of one example: None, or why not. Only what
    the harness answers for makes it invalid: it raised, crashed, broke the protocol, or its own code
    and tool calls took over `timeout` seconds. Its model time does not: a lone rollout's share of
    each batch is the whole batch, so the machine's speed and load would decide (on a loaded machine
    a valid 4-call chess harness took 45 s of model time, and two were dropped at 60 s). A rollout the
    model ran past the deadline goes on to be scored, where real batches share the model and the
    sandbox's deadline holds each rollout to its share (jail/sandbox.py)."""
    rec = run(engine, domain, source, [example], 1, seed=seed, sampling=sampling, max_tokens=max_tokens,
              rollout_timeout=timeout)[0]
    if rec["status"] == "ok" or (rec["status"] == "timeout" and rec["charged_s"] - rec["model_s"] <= timeout):
        return None
    return f"{rec['status']}: {rec['error']}"


@contextlib.contextmanager
def bar(engine, total: int, desc: str, also=None, quiet: bool = False):
    """A progress bar of one evaluation or candidate (total rollouts; `also`: another bar the same
    rollouts move, the run's; quiet: another rank shows it) that never goes silent: rollouts finish
    a wave at a time, so while one runs the bar counts the tokens the engine samples
    (engine.on_tokens, the HF sampler's decode loop; at most one redraw a second). Yields what
    rollout.run's `progress` takes.
    """
    from tqdm import tqdm
    shown = tqdm(total=total, unit="rollout", desc=desc, leave=False, disable=quiet)
    tokens, last = [0], [time.monotonic()]

    def on_tokens(k):
        tokens[0] += k
        if time.monotonic() - last[0] >= 1.0:
            last[0] = time.monotonic()
            shown.set_postfix_str(f"{tokens[0]:,} tokens sampled")

    def update(k):
        shown.update(k)
        if also is not None:
            also.update(k)
    engine.on_tokens = on_tokens
    try:
        # (a namespace, not a class: a class is freed only by the cycle collector, and would keep the
        # run's bar alive past a Ctrl-C, to be redrawn after the "interrupted" line)
        yield types.SimpleNamespace(update=update)
    finally:
        engine.on_tokens = None
        shown.close()


def tell_states(llm_batch, states):
    """llm_batch that also sets `latest_replies` on the states of the rollouts it answers: the texts
    of each one's latest llm() call (n of them for llm(..., n=)), so that a domain's tools can check
    an argument against what the model wrote (chess: a move must be one the model named), and
    `latest_prompt`, the messages of that call (chess: the prompt must not single the move out).
    A rollout has at most one llm() call waiting, so all of its calls in a batch are that one
    call's replies."""
    def answer(calls):
        outs = llm_batch(calls)
        latest = {}
        for c, o in zip(calls, outs):  # (a refused call leaves no reply: nothing to name a move in)
            latest.setdefault(c["rid"], []).extend([o["text"]] if "text" in o else [])
        for rid, texts in latest.items():
            if hasattr(states.get(rid), "latest_replies"):
                states[rid].latest_replies = texts
        for c, o in zip(calls, outs):  # and what the harness showed the model in that call (chess: did it lead it?)
            if "text" in o and hasattr(states.get(c["rid"]), "latest_prompt"):
                states[c["rid"]].latest_prompt = c["messages"]
        return outs
    return answer


def context_tokens(engine) -> int:
    """The model's context length (vLLM's max_model_len where it is set lower)."""
    return getattr(engine, "max_model_len", None) or engine.model.config.max_position_embeddings


def make_llm_batch(engine, sampling: dict, max_tokens: int):
    """The sandbox's llm_batch for this engine: chat template, the token cap, one engine.sample
    for every call that fits. A call whose prompt is over MAX_PROMPT_TOKENS or the context gets
    {"error"} (a ToolError in the harness) and is never prefilled."""
    context = context_tokens(engine)

    def llm_batch(calls):
        outs, reqs, where = [None] * len(calls), [], []
        for k, c in enumerate(calls):
            ids = engine.chat_ids(c["messages"])
            new = min(int(c["max_tokens"]), max_tokens)
            cap = min(MAX_PROMPT_TOKENS, context - new)
            if len(ids) > cap:
                outs[k] = {"error": f"prompt of {len(ids)} tokens is over the {cap}-token cap "
                                    f"(MAX_PROMPT_TOKENS={MAX_PROMPT_TOKENS}, context {context}, {new} new tokens)"}
                continue
            reqs.append({"prompt_ids": ids, "max_tokens": new, "stop": c.get("stop") or [], "seed": c["seed"],
                         **sampling})
            where.append(k)
        for k, r, o in zip(where, reqs, engine.sample(reqs) if reqs else []):
            outs[k] = {"text": o["text"], "prompt_ids": r["prompt_ids"], "completion_ids": o["completion_ids"],
                       "finish": o["finish"]}
        crash_point("sampling")
        return outs

    return llm_batch


def reply(engine, prompt: str, max_tokens: int, *, sampling: dict, seed: int) -> dict:
    """One model reply to one user message outside any harness (the `self` proposer writing
    harness code): {"text", "prompt_tokens", "completion_tokens", "finish"}. The reply is cut
    to what the model's context has room for; a prompt that fills it is a ValueError."""
    ids = engine.chat_ids([{"role": "user", "content": prompt}])
    context = context_tokens(engine)
    if len(ids) >= context:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's {context}-token context")
    out = engine.sample([{"prompt_ids": ids, "max_tokens": min(max_tokens, context - len(ids)), "stop": [],
                          "seed": seed, **sampling}])[0]
    return {"text": out["text"], "prompt_tokens": len(ids), "completion_tokens": len(out["completion_ids"]),
            "finish": out.get("finish")}


def score(domain, example, record, state) -> float:
    """The verifier's verdict; a rollout that crashed, hung or broke the protocol scores 0,
    and a verifier that chokes on junk scores it 0 rather than ending the run."""
    if record["status"] != "ok":
        return 0.0
    try:
        return float(domain.verify(example, record["answer"], state) > 0.5)
    except Exception as e:  # the answer is untrusted text
        record["error"] = f"verifier: {type(e).__name__}: {e}"
        return 0.0


def per_example_means(records) -> dict:
    out = {}
    for r in records:
        out.setdefault(r["example_id"], []).append(r["score"])
    return {k: float(np.mean(v)) for k, v in out.items()}


def mean_at_k(records) -> tuple[float, float]:
    """mean@k: per example the mean score over its k samples, then the mean over
    examples (not pass@k), with its standard error over examples."""
    means = np.array(list(per_example_means(records).values()), dtype=float)
    if len(means) == 0:
        return 0.0, 0.0
    se = float(means.std(ddof=1) / np.sqrt(len(means))) if len(means) > 1 else 0.0
    return float(means.mean()), se


def text_sampler(engine, a):
    """llm_text(prompt, max_tokens) for the `self` proposer: the policy model at the run's sampling
    settings (a: whale.Args), seeded by the prompt, so a resumed search asks and hears the same."""
    def llm_text(prompt, max_tokens):
        return reply(engine, prompt, max_tokens, sampling={"temperature": a.temperature, "top_k": a.top_k,
                     "top_p": a.top_p}, seed=stable_seed(a.seed, "proposer", prompt))
    return llm_text


def paired_gain(a, b) -> tuple[float, float]:
    """mean@k of b - mean@k of a ({example_id: mean score} each, from per_example_means) on the
    examples both scored, with the standard error of the per-example differences: the same
    questions on both sides, so the question-to-question spread cancels out of the SE."""
    d = np.array([b[k] - a[k] for k in a if k in b], dtype=float)
    if len(d) < 2:
        return float(d.mean()) if len(d) else 0.0, 0.0
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


def totals(records) -> dict:
    """Counters a run accumulates: rollouts and tokens (prompt tokens count each llm call's whole prompt)."""
    return {"rollouts": len(records),
            "prompt_tokens": int(sum(r["prompt_tokens"] for r in records)),
            "completion_tokens": int(sum(r["completion_tokens"] for r in records)),
            "errors": int(sum(r["status"] != "ok" for r in records))}


def evaluate(engine, domain, source, examples, n, *, seed, sampling, max_tokens=256, progress=None) -> dict:
    """mean@n of a harness on a split, with counters and timing."""
    t0 = time.time()
    records = run(engine, domain, source, examples, n, seed=seed, sampling=sampling,
                  max_tokens=max_tokens, progress=progress)
    mean, se = mean_at_k(records)
    return {"mean": mean, "se": se, "n": n, "examples": len(examples), "seconds": time.time() - t0,
            **totals(records), "records": records}
