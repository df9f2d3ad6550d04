"""
WHALE: Weight-Harness Alternating LEarning (arXiv 2609.00196), the whole loop.

An LLM agent is its weights plus its harness (the code that builds prompts,
calls tools, parses answers and decides when to stop). WHALE improves both:
  phase A (rs_sft.py)        roll out under the current harness, keep verified
                             rollouts, fine-tune on the model's own tokens;
  phase B (meta_harness.py)  a proposer (proposers.py) writes new harness files from
                             an archive of candidates, scores and traces; the best carries on;
  switch.py                  decides when to change phase (fixed or adaptive).
Methods (all at the same budget of target rollouts): whale, fst (harness search
may change prompt text only), weight-only, harness-only, stagewise (all weight
steps first, then all harness search), and eval (score a model + harness).

    python whale.py --domain searchqa                  # WHALE on the embedded model
    python whale.py --domain math --method weight-only
    python whale.py --resume runs/searchqa-whale-s0    # continue after a crash

Left out on purpose: multi-node training and asynchronous rollouts. Data-parallel
phase A runs under torchrun (see README); everything else is this one process.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve the sandbox child
import dataclasses
import importlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from run_setup import UserError, open_run  # check_args, the run directory: before the loop


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    domain: str = arg("searchqa", "task family: a file domains/<name>.py (searchqa, math, chess)")
    method: str = arg("whale", "whale | fst | weight-only | harness-only | stagewise | eval")
    schedule: str = arg("fixed-steps:4,3", "switch policy: fixed:E,I (epochs) | fixed-steps:S,I | adaptive[:w=..] "
                                           "(I counts the incoming harness: 3 = two proposer iterations)")
    budget: int = arg(1664, "total target rollouts (phase A + phase B), the same for every method "
                            "(default: 4 + 2 RSFT steps of 128 and one harness phase of 1 + 2 x 3 candidates x 128)")
    seed: int = arg(0, "seed for data order, sampling and proposals")
    out: str = arg("", "run directory (default runs/<domain>-<method>-s<seed>)")
    resume: str = arg("", "continue the run in this directory from its last checkpoint")
    model: str = arg("embedded", "'embedded' (SmolLM2-135M-Instruct), an HF id, a local dir or a .gguf file "
                                 "(converted once into $WHALE_CACHE/gguf)")
    chat_format: str = arg("auto", "auto | template | plain: the tokenizer's chat template, or plain text turns "
                                   "'User: ...\\n\\nAssistant:' (auto: plain if the model has no template)")
    engine: str = arg("hf", "sampler: hf (plain PyTorch loop) or vllm")
    device: str = arg("cpu", "cpu or cuda")
    tp: int = arg(1, "vLLM tensor parallelism: GPUs per sampling engine (--engine vllm)")
    harness: str = arg("", "start from this harness file instead of the domain's h0")
    # phase A
    prompts_per_step: int = arg(16, "B: prompts per rollout step")
    group: int = arg(8, "G: rollouts per prompt")
    lr: float = arg(3e-4, "AdamW learning rate (top-K-layer training on CPU; the paper's full 2B runs use ~1e-7)")
    minibatch: int = arg(16, "sequences per optimizer step")
    micro_batch: int = arg(8, "sequences per forward/backward (gradient accumulation)")
    clip: float = arg(1.0, "gradient-norm clip")
    train_layers: int = arg(4, "train only the top K blocks (0 = full fine-tuning)")
    max_kept_per_prompt: int = arg(2, "at most this many kept rollouts per prompt (0 = all)")
    # phase B
    proposer: str = arg("primitives", "primitives | self | openai | command")
    proposer_url: str = arg("", "openai proposer: base URL of an OpenAI-compatible endpoint")
    proposer_model: str = arg("", "openai proposer: model name")
    proposer_command: str = arg("", "command proposer: the coding agent CLI run in a copy of the archive, the "
                                    "prompt on stdin (README: recipes for claude -p and codex exec)")
    proposer_max_tokens: int = arg(4096, "self/openai proposer: reply length limit in tokens (a whole seed "
                                         "harness is ~700-1,200 tokens)")
    proposer_timeout: float = arg(0.0, "openai: seconds per request (0 = 600); command: seconds per agent run "
                                       "(0 = 1800)")
    proposer_api_key_env: str = arg("OPENAI_API_KEY", "openai proposer: the environment variable holding the API key")
    proposer_format: str = arg("any", "self/openai proposer: ask for a whole file, search/replace edit blocks "
                                      "against the parent, or either (file | edit | any)")
    proposer_digest_chars: int = arg(16000, "self/openai/command proposer: character budget of the archive view "
                                            "in the prompt")
    candidates: int = arg(3, "M: candidates per harness iteration")
    harness_examples: int = arg(64, "examples of the harness search set used (0 = all)")
    harness_n: int = arg(2, "rollouts per harness-search example (the prefill is shared, so n=2 costs little)")
    accept_alpha: float = arg(0.2, "a candidate replaces the incumbent only if the paired sign test p <= this")
    # sampling and evaluation
    temperature: float = arg(0.3, "sampling temperature (training, search, evaluation); the paper uses 1.0 "
                                            "with 2B models, where the 135M default scores ~0 exact match")
    top_k: int = arg(20, "top-k of sampling")
    top_p: float = arg(1.0, "top-p of sampling")
    max_tokens: int = arg(48, "cap on new tokens per llm() call (the parent enforces it)")
    test_n: int = arg(8, "samples per test question: mean@test_n")
    test_limit: int = arg(100, "first N test questions (0 = all 250); 100 keeps the CPU default near 20 min")
    test_split: str = arg("test", "the held-out split scored as 'test' (initial, final, best-on-val): test, or val "
                                  "to choose settings without ever reading the test split")
    val_n: int = arg(2, "samples per validation question")
    val_limit: int = arg(32, "validation questions evaluated after every phase (0 = all)")
    test_subset: int = arg(0, "also evaluate this many test questions after every phase (curves)")


def parse_args(argv=None) -> Args:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    for f in dataclasses.fields(Args):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


def main(a: Args):
    import meta_harness
    import rollout
    import rs_sft
    import run_dir as rd
    import switch
    from engine import load_engine
    from tqdm import tqdm

    # ---- under torchrun every rank rolls out and trains its shard of phase A (rs_sft.py);
    # rank 0 alone writes files, logs, evaluates and runs phase B, and hands its state on
    rank, world, device = rs_sft.ddp_setup(a.device)

    # ---- the run directory: new, or resumed from its last checkpoint
    run, a = rs_sft.broadcast(open_run(a) if rank == 0 else None, world)
    ckpt = run / "checkpoint"
    state = rd.read_json(ckpt / "state.json") if (ckpt / "state.json").exists() else None
    if rank == 0:
        kept = rd.truncate_metrics(run, state["metrics_lines"] if state else 0)
        if state:
            state["metrics_lines"] = kept

    domain = importlib.import_module(f"domains.{a.domain}")
    splits = {s: domain.load_split(s) for s in ("weight", "harness", "val", "test")}  # checked in check_args
    test, val = splits[a.test_split][:a.test_limit or None], splits["val"][:a.val_limit or None]
    search_set = splits["harness"][:a.harness_examples or None]
    sampling = {"temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p}
    h0 = Path(a.harness or domain.H0).read_text()
    engine = load_engine(str(ckpt) if state else a.model, engine=a.engine, device=device, tp=a.tp, seed=a.seed,
                         chat_format=a.chat_format)
    policy = switch.parse_schedule(a.schedule)
    steps_per_epoch = max(1, len(splits["weight"]) // a.prompts_per_step)
    step_cost = a.prompts_per_step * a.group                       # one phase-A rollout step
    iter_cost = len(search_set) * a.harness_n * a.candidates       # one phase-B iteration

    if state is None:
        state = {"phase": "B" if a.method == "harness-only" else "A", "cycle": 0, "steps": 0, "rollouts": 0,
                 "harness": h0, "loader": rs_sft.new_loader(len(splits["weight"]), a.seed), "phase_rewards": [],
                 "evals": [], "best_val": None, "pending_eval": "initial", "done": False, "seconds": 0.0,
                 "metrics_lines": 0, "counters": {"prompt_tokens": 0, "completion_tokens": 0, "proposer_calls": 0,
                              "proposer_prompt_tokens": 0, "proposer_completion_tokens": 0, "proposer_seconds": 0.0,
                              "proposer_cost_usd": 0.0, "harness_candidates": 0, "harness_invalid": 0}}
    trainable = rs_sft.set_trainable(engine.model, a.train_layers)
    optimizer = rs_sft.make_optimizer(trainable, a.lr)
    ddp_model = rs_sft.ddp_wrap(engine.model)  # None in one process
    if (ckpt / "optimizer.pt").exists():
        import torch
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt"))
    t_start = time.time() - state["seconds"]
    bar = tqdm(total=a.budget, initial=state["rollouts"], unit="rollout", desc=f"{a.method} {a.domain}",
               dynamic_ncols=True, disable=rank != 0)

    def log(row):
        if rank != 0:
            return
        row = {"t": round(time.time() - t_start, 1), **row, "rollouts": state["rollouts"]}  # cumulative
        rd.log_metrics(run, row, state)
        bar.write(" ".join(f"{k}={round(v, 4) if isinstance(v, float) else v}" for k, v in row.items()
                           if not isinstance(v, (list, dict)) and v is not None))

    log({"event": "start", "commit": rd.code_version(), "argv": sys.argv[1:]})  # which code made this run

    def checkpoint(model_changed: bool):
        if rank != 0:
            return
        state["seconds"] = time.time() - t_start
        rd.save_checkpoint(run, engine, optimizer, state, model_changed=model_changed)

    def evaluate(split, examples, n, tag, harness=None):
        """mean@n of (current weights, harness). The first test evaluation of (model, h0)
        is the same for every method of a domain and seed, so it is cached and reused."""
        harness = harness or state["harness"]
        key = rd.eval_key(vars(a), harness, examples, n, split) if tag == "initial" else None
        res = rd.load_cached_eval(key)
        if res is None or "per_example" not in res:  # (entries from before per-example scores were kept)
            with tqdm(total=len(examples) * n, unit="rollout", desc=f"eval {split} mean@{n}", leave=False) as pb:
                res = rollout.evaluate(engine, domain, harness, examples, n, seed=(a.seed, split), sampling=sampling,
                                       max_tokens=a.max_tokens, progress=pb)
            res["per_example"] = rollout.per_example_means(res.pop("records"))  # for paired test gains
        rd.store_cached_eval(key, res)
        point = {"split": split, "tag": tag, "cycle": state["cycle"], "rollouts": state["rollouts"],
                 **{k: res[k] for k in ("mean", "se", "n", "examples")}}
        if split == "test":
            point["per_example"] = res["per_example"]
        state["evals"].append(point)
        log({"event": "eval", **point, "seconds": round(res["seconds"], 1)})
        return point

    def after_phase():
        """Evaluate the new (weights, harness) on validation (and a test subset); keep the best on val."""
        tag, better = state["pending_eval"], False
        if tag == "initial":
            evaluate("test", test, a.test_n, "initial")
        if a.method != "eval":
            v = evaluate("val", val, a.val_n, tag)
            if a.test_subset and tag != "initial":
                evaluate("test_subset", test[:a.test_subset], a.test_n, tag)
            better = state["best_val"] is None or v["mean"] > state["best_val"]["mean"]
            if better:
                state["best_val"] = {**v, "harness": state["harness"]}
        state["pending_eval"] = None
        checkpoint(model_changed=False)
        if better:
            rd.copy_checkpoint(run, "checkpoint", "best_val")

    # ---- the alternating loop: phase A and phase B until the rollout budget is spent
    stagewise_weight = switch.weight_share(policy, steps_per_epoch, step_cost, iter_cost, len(search_set) * a.harness_n)
    while True:
        if state["pending_eval"] and rank == 0:
            after_phase()
        state = rs_sft.broadcast(state, world)  # the one sync point: all ranks take rank 0's decisions
        if state["done"] or a.method == "eval":
            break
        if state["phase"] == "A":
            # phase A: one RSFT rollout step (rollouts -> verified -> SFT) under the current harness
            m = rs_sft.rollout_step(engine, domain, state["harness"], splits["weight"], state["loader"], optimizer,
                                    batch=a.prompts_per_step, group=a.group, seed=(a.seed, "A", state["steps"]),
                                    sampling=sampling, max_kept_per_prompt=a.max_kept_per_prompt,
                                    minibatch=a.minibatch, micro_batch=a.micro_batch, clip=a.clip,
                                    max_tokens=a.max_tokens, progress=bar, ddp_model=ddp_model,
                                    shard=(rank, world))
            state["rollouts"] += m["rollouts"]
            state["steps"] += 1
            state["phase_rewards"].append(m["train_reward"])
            for k in ("prompt_tokens", "completion_tokens"):
                state["counters"][k] += m[k]
            log({"event": "rollout_step", "cycle": state["cycle"], "step": state["steps"], **m,
                 "step_rollouts": m["rollouts"]})
            left = a.budget - state["rollouts"]
            if left < step_cost:
                # budget spent: the run ends after this weight phase (stagewise still owes its harness stage)
                over, state["done"] = True, a.method != "stagewise"
            elif a.method == "weight-only" or (a.method != "stagewise" and left < iter_cost + step_cost):
                over = False  # no room for another harness phase: this weight phase runs to the end
            elif a.method == "stagewise":
                over = state["rollouts"] >= stagewise_weight * a.budget
            else:
                over = policy.weight_done(state["phase_rewards"], steps_per_epoch)
            if over:
                state.update(phase="B", phase_rewards=[], pending_eval=f"A{state['cycle']}")
            checkpoint(model_changed=True)
        elif rank == 0:  # the other ranks wait in the broadcast above
            # phase B: Meta-Harness search from the current harness, in its own archive
            archive = run / "archive" / f"phase{state['cycle']:02d}"
            reserve = step_cost if a.method in ("whale", "fst") else 0  # leave room for the final weight phase

            def should_stop(history):  # -> why the phase ends (a string), or False
                spent = meta_harness.spent_rollouts(str(archive))
                if state["rollouts"] + spent + iter_cost + reserve > a.budget:
                    return f"budget: {state['rollouts'] + spent} of {a.budget} rollouts spent, an iteration costs {iter_cost}"
                return a.method in ("whale", "fst") and policy.harness_done(history) and "switch policy: harness phase done"

            def eval_candidate(source, examples, tag):
                records = rollout.run(engine, domain, source, examples, a.harness_n, seed=(a.seed, "B", state["cycle"]),
                                      sampling=sampling, max_tokens=a.max_tokens, progress=bar)
                rd.crash_point("harness_eval")
                return records

            def validate_run(source):
                rec = rollout.run(engine, domain, source, search_set[:1], 1, seed=(a.seed, "validate"),
                                  sampling=sampling, max_tokens=a.max_tokens, rollout_timeout=60)[0]
                return None if rec["status"] == "ok" else f"{rec['status']}: {rec['error']}"

            res = meta_harness.search_phase(
                state["harness"], domain, search_set, eval_candidate, validate_run, make_proposer(a, domain, engine),
                archive_dir=str(archive), k=a.candidates, should_stop=should_stop, accept_alpha=a.accept_alpha,
                prompt_only_base=h0 if a.method == "fst" else None,
                log=lambda e: log({"event": e.pop("event"), "cycle": state["cycle"], **e}))  # console + metrics.jsonl
            state["rollouts"] += res["counters"].get("rollouts", 0)
            for k in ("proposer_calls", "proposer_prompt_tokens", "proposer_completion_tokens", "proposer_seconds",
                      "proposer_cost_usd", "candidates", "invalid"):  # the proposer's cost, in summary.json
                key = k if k.startswith("proposer") else f"harness_{k}"
                state["counters"][key] = round(state["counters"].get(key, 0) + res["counters"].get(k, 0), 6)
            state["harness"] = res["best_source"]
            (run / "harnesses").mkdir(exist_ok=True)
            (run / "harnesses" / f"cycle{state['cycle']:02d}.py").write_text(state["harness"])
            state.update(phase="A", cycle=state["cycle"] + 1, pending_eval=f"B{state['cycle']}",
                         done=a.method in ("harness-only", "stagewise"))
            checkpoint(model_changed=False)
    if rank == 0:
        finish(a, run, state, engine, evaluate, test, checkpoint, bar, t_start)


def finish(a, run, state, engine, evaluate, test, checkpoint, bar, t_start):
    """Final test mean@k, the best-on-validation checkpoint on test, summary.json, curve.png."""
    import rollout
    import run_dir as rd
    bar.close()
    tests = {e["tag"]: e for e in state["evals"] if e["split"] == "test"}
    if a.method != "eval" and "final" not in tests:
        tests["final"] = evaluate("test", test, a.test_n, "final")
        checkpoint(model_changed=False)
    initial = tests["initial"]
    final = tests.get("final", initial)
    best = state["best_val"]
    if best is None or best["tag"] == "initial":
        best_val_test = initial
    elif best["rollouts"] == state["rollouts"] and best["harness"] == state["harness"]:
        best_val_test = final
    else:  # the point chosen on validation is an earlier one: load it and score it on the full test split
        from safetensors.torch import load_file
        engine.model.load_state_dict(load_file(run / "best_val" / "model.safetensors"), strict=False)
        engine.sync_weights()
        best_val_test = evaluate("test", test, a.test_n, "best_val", harness=best["harness"])
        tests["best_val"] = best_val_test
    best_test = max(tests.values(), key=lambda e: e["mean"])
    gain, gain_se = rollout.paired_gain(initial["per_example"], final["per_example"])
    state["seconds"] = time.time() - t_start
    summary = {"method": a.method, "domain": a.domain, "seed": a.seed, "model": a.model,
               "rollouts": state["rollouts"], "budget": a.budget, "cycles": state["cycle"], "steps": state["steps"],
               "test_mean8_initial": initial["mean"], "test_mean8_initial_se": initial["se"],
               "test_mean8_final": final["mean"], "test_mean8_final_se": final["se"],
               "test_gain": gain, "test_gain_se": gain_se,  # final - initial, SE paired over the same questions
               "test_mean8_best_val": best_val_test["mean"], "test_mean8_best_val_se": best_val_test["se"],
               "test_mean8_best_test": best_test["mean"], "test_mean8_best_test_se": best_test["se"],
               "best_test_note": "selected on the test split (the paper's metric), over the full-test evaluations "
                                 f"of this run: {sorted(tests)}",
               "test_split": a.test_split, "test_examples": initial["examples"], "test_n": a.test_n,
               "test_subset_curve": a.test_subset, **state["counters"], "seconds": round(state["seconds"], 1)}
    rd.write_json(run / "summary.json", summary)
    rd.plot_curve(run, state["evals"], f"{a.method} on {a.domain} (seed {a.seed})")
    print(f"\n{a.method} on {a.domain}, seed {a.seed}: {state['rollouts']} target rollouts in "
          f"{state['seconds'] / 60:.1f} min")
    print(f"  {a.test_split} mean@{a.test_n} ({initial['examples']} questions)  initial {initial['mean']:.3f} "
          f"+- {initial['se']:.3f}   final {final['mean']:.3f} +- {final['se']:.3f}")
    print(f"  gain {gain:+.3f} +- {gain_se:.3f} (SE of the per-question differences)")
    if a.method != "eval":
        print(f"  best-on-validation checkpoint: {a.test_split} {best_val_test['mean']:.3f} +- {best_val_test['se']:.3f}")
    print(f"  files: {run}/ (summary.json, metrics.jsonl, harnesses/, checkpoint/, curve.png)")
    try:  # the page is a view of the files above: if it breaks, the run is still whole
        import report
        print(f"  report: {report.write_report(run)}")
    except Exception as e:
        print(f"whale: warning: report.html not written ({type(e).__name__}: {e}); "
              f"retry with python report.py {run}", file=sys.stderr)


# -----------------------------------------------------------------------------
# helpers of the loop

def make_proposer(a: Args, domain, engine):
    import proposers
    import rollout

    def llm_text(prompt, max_tokens):  # the `self` proposer: the policy model writes harness code
        ids = engine.chat_ids([{"role": "user", "content": prompt}])
        context = getattr(engine.model.config, "max_position_embeddings", None) or len(ids) + max_tokens
        if len(ids) >= context:  # an error for this candidate, not a crash of the run
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's {context}-token context; "
                             "lower --proposer-digest-chars")
        req = {"prompt_ids": ids, "max_tokens": min(max_tokens, context - len(ids)),
               "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p, "stop": [],
               "seed": rollout.stable_seed(a.seed, "proposer", prompt)}
        out = engine.sample([req])[0]
        return {"text": out["text"], "prompt_tokens": len(ids), "completion_tokens": len(out["completion_ids"]),
                "finish": out.get("finish")}
    return proposers.make_proposer(a.proposer, domain, llm_text=llm_text, base_url=a.proposer_url or None,
                                   model=a.proposer_model or None, api_key_env=a.proposer_api_key_env,
                                   command=a.proposer_command or None, rng_seed=a.seed,
                                   max_tokens=a.proposer_max_tokens, timeout=a.proposer_timeout or None,
                                   digest_chars=a.proposer_digest_chars, reply_format=a.proposer_format)


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as e:
        print(f"whale: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nwhale: interrupted; continue with --resume <run dir>", file=sys.stderr)
        sys.exit(130)
