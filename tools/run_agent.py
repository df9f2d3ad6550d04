"""
Run an exported agent (tools/export.py) outside WHALE: its harness answers tasks the way the run
scored it. The harness is untrusted code in deployment too, so it runs in the same sandbox
(jail/sandbox.py), and its llm() calls get what training gave them: the exported tokenizer's chat
template, the run's stop handling, token cap, `n=` batching and sampling settings (agent.json).

    agent = load_agent("agent/")                                     # the project's own engine
    agent = load_agent("agent/", endpoint="http://127.0.0.1:8000/v1")  # e.g. `vllm serve agent/model`
    answer = agent({"question": "..."})["answer"]

    python tools/run_agent.py agent/ --split test --limit 100 --out answers.jsonl   # scored (the domain's verifier)
    python tools/run_agent.py agent/ --tasks tasks.jsonl --out answers.jsonl        # your own tasks, unscored

The tools are the domain's (its make_tools needs the example a task came from: a domain's split
gives it), or your own: `load_agent(..., tools=make_tools)` with make_tools(task) -> an object
whose methods the harness calls. With an endpoint, prompts are rendered here and sent as token ids
to `/completions` (so the template is the exported one, not the server's); the reply's tokens are
the server's text tokenized again (a deployment trains on nothing). Left out: batching several
callers' tasks into one sampler batch, streaming, retries of a failed request.
"""
import argparse
import json
import re
import sys
import types
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python tools/x.py` imports the repository's modules


class AgentError(Exception):
    """A mistake in what was asked: one line, exit 2."""


class EndpointEngine:
    """The sampler interface rollout.py uses (chat_ids, sample, model's context), over an
    OpenAI-compatible /completions endpoint: token-id prompts, one choice per request, its seed."""

    def __init__(self, url: str, model_dir: Path, chat_format: str, timeout: float = 120.0):
        from transformers import AutoConfig, AutoTokenizer

        from lm.chat_format import chat_stop_strings, resolve_chat_format, stop_token_ids
        self.url, self.timeout = url.rstrip("/"), timeout
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        self.chat_format = resolve_chat_format(self.tokenizer, chat_format)
        self.chat_stops = chat_stop_strings(self.chat_format)
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
        self.max_model_len = config.max_position_embeddings
        from transformers import GenerationConfig
        self.eos_ids = sorted(stop_token_ids(self.tokenizer, GenerationConfig.from_pretrained(model_dir)))
        self.served = self._model_name()

    def _post(self, path, body=None):
        """The endpoint's JSON reply: someone else's server, so the reply is capped in bytes, the
        request bounded in time as a whole, redirects kept to its origin (jail/received.py)."""
        from jail import received
        req = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return received.loads(received.http_body(req, self.timeout), f"{self.url}{path}'s reply")

    def _model_name(self):
        try:
            return self._post("/models")["data"][0]["id"]
        except Exception as e:
            raise AgentError(f"endpoint {self.url} does not answer /models ({type(e).__name__}: {e})") from None

    def chat_ids(self, messages):
        from lm.chat_format import chat_ids
        return chat_ids(self.tokenizer, messages, self.chat_format)

    def sample(self, requests):
        out = []
        for r in requests:
            body = {"model": self.served, "prompt": list(r["prompt_ids"]), "max_tokens": int(r["max_tokens"]),
                    "temperature": float(r.get("temperature", 1.0)), "top_p": float(r.get("top_p") or 1.0),
                    "top_k": int(r.get("top_k") or -1) or -1, "n": 1, "seed": int(r["seed"]) % 2**31,
                    "stop": list(r.get("stop") or []) + self.chat_stops or None, "stop_token_ids": self.eos_ids}
            try:
                choice = self._post("/completions", body)["choices"][0]
                text = choice.get("text") or ""
                if not isinstance(text, str):
                    raise TypeError("its text is not a string")
            except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
                raise AgentError(f"endpoint {self.url} gave no completion ({type(e).__name__}: {str(e)[:200]})") from None
            finish = "length" if choice.get("finish_reason") == "length" else (
                "stop" if isinstance(choice.get("stop_reason"), str) else "eos")
            out.append({"text": text, "completion_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"],
                        "finish": finish})
        return out


def read_agent(out: Path) -> dict:
    try:
        from jail import received  # a bundle is someone else's: no links followed, sizes capped
        agent = received.read_json(out / "agent.json", root=out)
        harness = received.read_text(out / "harness.py", root=out)
    except (OSError, ValueError) as e:
        raise AgentError(f"{out} is not an exported agent (agent.json, harness.py: {type(e).__name__})") from None
    if not (isinstance(agent, dict) and isinstance(agent.get("domain"), str)
            and re.fullmatch(r"[a-z][a-z0-9_]*", agent["domain"]) and (ROOT / "domains" / f"{agent['domain']}.py").is_file()):
        raise AgentError(f"{out}/agent.json names no domain of this checkout")
    from harness_search.harness_source import static_check
    why = static_check(harness)
    if why:
        raise AgentError(f"{out}/harness.py is not a harness: {why}")
    return dict(agent, harness=harness)


def load_agent(out, endpoint: str | None = None, tools=None, sampling: dict | None = None, device: str = "cpu"):
    """A callable: task (the dict a harness gets), or an example of the agent's domain ({id, task, ...}),
    -> {"answer", "score" (None without the domain's verifier), "record"}. `.answer_all(examples, n=1,
    seed=None)` runs many as one batch, as evaluation runs them; seed None: the run's test seeds, so
    that the run's test questions get the very rollouts its final evaluation had. tools: make_tools(task) -> the tools
    object (default: the domain's, which needs an example of its own split). sampling: overrides
    agent.json's temperature/top_k/top_p (e.g. {"temperature": 0} for greedy)."""
    import importlib

    import rollout
    out = Path(out)
    agent = read_agent(out)
    domain = importlib.import_module(f"domains.{agent['domain']}")
    settings = {**agent["sampling"], **(sampling or {})}
    max_tokens = settings.pop("max_tokens")
    if endpoint:
        engine = EndpointEngine(endpoint, out / "model", agent.get("chat_format") or "auto")
    else:
        from lm.engine import load_engine
        engine = load_engine(str(out / "model"), device=device, chat_format=agent.get("chat_format") or "auto")
    if tools is None:
        run_with = domain
    else:  # the user's tools: no verifier (scores are None)
        run_with = types.SimpleNamespace(make_tools=lambda example: (tools(example["task"]), None),
                                         verify=lambda example, answer, state=None: 0.0)

    def answer_all(examples, n: int = 1, seed=None):
        scored = tools is None and all("task" in ex and "id" in ex for ex in examples)  # the domain's own examples
        examples = [ex if "task" in ex else {"id": str(k), "task": ex} for k, ex in enumerate(examples)]
        records = rollout.run(engine, run_with, agent["harness"], examples, n,
                              seed=(agent["seed"], "test") if seed is None else seed,
                              sampling=settings, max_tokens=max_tokens)
        return [{"answer": r.get("answer"), "score": r["score"] if scored else None, "record": r} for r in records]

    def agent_call(task_or_example):
        return answer_all([task_or_example])[0]
    agent_call.answer_all, agent_call.engine, agent_call.info = answer_all, engine, agent
    return agent_call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run an exported agent on tasks; score them where the domain can.")
    ap.add_argument("agent", help="an exported agent folder (tools/export.py)")
    ap.add_argument("--tasks", help="a JSONL of tasks (each the dict its harness gets), or of the domain's examples")
    ap.add_argument("--split", help="instead of --tasks: the domain's split (weight, harness, val, test)")
    ap.add_argument("--limit", type=int, default=0, help="the first N tasks (0 = all)")
    ap.add_argument("--n", type=int, default=1, help="samples per task (mean@n when scored)")
    ap.add_argument("--endpoint", default="", help="an OpenAI-compatible base URL (e.g. vllm serve): its sampler")
    ap.add_argument("--greedy", action="store_true", help="temperature 0 instead of the run's sampling")
    ap.add_argument("--out", required=True, help="answers and traces, one JSON line per task x sample")
    a = ap.parse_args(argv)
    try:
        if bool(a.tasks) == bool(a.split):
            raise AgentError("give --tasks FILE or --split NAME (one of them)")
        agent = load_agent(a.agent, endpoint=a.endpoint or None, sampling={"temperature": 0.0} if a.greedy else None)
        if a.split:
            import importlib
            examples = importlib.import_module(f"domains.{agent.info['domain']}").load_split(a.split)
        else:
            try:
                examples = [json.loads(x) for x in Path(a.tasks).read_text().splitlines() if x.strip()]
            except (OSError, ValueError) as e:
                raise AgentError(f"--tasks {a.tasks}: not a JSONL file ({type(e).__name__})") from None
        examples = examples[:a.limit or None]
        results = agent.answer_all(examples, n=a.n)
    except AgentError as e:
        print(f"run_agent: error: {e}", file=sys.stderr)
        return 2
    with open(a.out, "w") as f:
        for r in results:
            rec = r["record"]
            f.write(json.dumps({"example_id": rec["example_id"], "sample": rec["sample"], "answer": r["answer"],
                                "score": r["score"], "status": rec["status"], "calls": [
                                    {"text": c.get("text"), "finish": c.get("finish")} for c in rec["calls"]]},
                               default=str) + "\n")
    scores = [r["score"] for r in results if r["score"] is not None]
    print(f"{len(results)} answers -> {a.out}" + (f"; mean@{a.n} {sum(scores) / len(scores):.4f}" if scores else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
