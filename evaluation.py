"""
How a WHALE run is scored: the evaluation protocol whale.py's loop calls between phases.

  initial     test mean@k of (model, starting harness), before anything is trained or searched;
              the same for every method of a domain and seed, so it is cached (run_dir.eval_key)
  after each  validation mean@k (+ the first --test-subset test questions, for curves), tagged
  phase       A<cycle>, B<cycle> or A<cycle>.<step> (--val-every); the best point on validation
              keeps its weights aside (run_dir: best_val/) with its harness
  final       test mean@k of the last (weights, harness), and of the best-on-validation point when
              that is an earlier one: the test split is read only here, and never to choose anything

Every evaluation is a line in metrics.jsonl and an entry of the run's state; test evaluations keep
their per-question means, so results.py can pair two runs question by question. `ctx` is the loop's
Context (whale.py): args, domain, engine, the splits, the sampling settings.
Left out: early stopping on validation (the run always spends its budget).
"""
import sys

import rollout
from rundir import run_dir as rd


def evaluate_and_log(run, ctx, split, examples, n, tag, harness=None):
    """mean@n of (current weights, harness) on examples; logged and kept in the state. The initial
    test evaluation of (model, h0) is the same for every method of a domain and seed: cached."""
    from tqdm import tqdm
    args, state = ctx.args, run.state
    harness = harness or state["harness"]
    key = rd.eval_key(vars(args), ctx.domain, harness, examples, n, split) if tag == "initial" else None
    res = rd.load_cached_eval(key)
    if res is None:
        with tqdm(total=len(examples) * n, unit="rollout", desc=f"eval {split} mean@{n}", leave=False) as bar:
            res = rollout.evaluate(ctx.engine, ctx.domain, harness, examples, n, seed=(args.seed, split),
                                   sampling=ctx.sampling, max_tokens=args.max_tokens, progress=bar)
        res["per_example"] = rollout.per_example_means(res.pop("records"))  # for paired gains
        rd.store_cached_eval(key, res)
    rd.crash_point("eval")  # (a testing aid: a kill after an evaluation, before its line and checkpoint)
    point = {"split": split, "tag": tag, "cycle": state["cycle"], "rollouts": state["rollouts"],
             **{k: res[k] for k in ("mean", "se", "n", "examples")}}
    if split == "test":
        point["per_example"] = res["per_example"]
    state["evals"].append(point)
    run.log({"event": "eval", **point, "seconds": round(res["seconds"], 1)})
    return point


def after_phase(run, ctx):
    """After a phase (and at the start): validation mean@k (+ the test subset of the curves), and
    the best checkpoint on validation kept aside. At the start, the initial test evaluation."""
    args, state = ctx.args, run.state
    tag, better = state["pending_eval"], False
    if tag is None:
        return
    if tag == "initial":
        evaluate_and_log(run, ctx, "test", ctx.test, args.test_n, "initial")
    if ctx.method is not None:
        v = evaluate_and_log(run, ctx, "val", ctx.val, args.val_n, tag)
        if args.test_subset and tag != "initial":
            evaluate_and_log(run, ctx, "test_subset", ctx.test[:args.test_subset], args.test_n, tag)
        better = state["best_val"] is None or v["mean"] > state["best_val"]["mean"]
        if better:
            state["best_val"] = {**v, "harness": state["harness"]}
    state["pending_eval"] = None
    run.checkpoint(ctx.engine, ctx.optimizer, model_changed=False)
    if better:
        run.keep_checkpoint_as("best_val")


def finish(run, ctx):
    """The final test mean@k, the best-on-validation checkpoint scored on test, summary.json."""
    args, state = ctx.args, run.state
    run.bar.close()
    tests = {e["tag"]: e for e in state["evals"] if e["split"] == "test"}
    if ctx.method is not None and "final" not in tests:
        tests["final"] = evaluate_and_log(run, ctx, "test", ctx.test, args.test_n, "final")
        run.checkpoint(ctx.engine, ctx.optimizer, model_changed=False)
    initial = tests["initial"]
    final = tests.get("final", initial)
    best = state["best_val"]
    if best is None or best["tag"] == "initial":
        best_val_test = initial
    elif best["rollouts"] == state["rollouts"] and best["harness"] == state["harness"]:
        best_val_test = final
    else:  # the point chosen on validation is an earlier one: load it and score it on the full test split
        run.load_weights("best_val", ctx.engine)
        best_val_test = tests["best_val"] = evaluate_and_log(run, ctx, "test", ctx.test, args.test_n, "best_val",
                                                             harness=best["harness"])
    rd.plot_curve(run.dir, state["evals"], f"{args.method} on {args.domain} (seed {args.seed})")
    gain = rollout.paired_gain(initial["per_example"], final["per_example"])  # final - initial, paired
    run.print_summary(run.write_summary(tests, best_val_test, gain))
    run.finish_tracker(write_report(run.dir))
    run.drop_optimizer()  # nothing trains after this: the run directory keeps only weights, state and records


def write_report(run_dir):
    """report.html beside the run's files (tools/report.py); its path, or None. The page is a view of
    the files: if it breaks, the run is still whole, and the warning says how to write it again."""
    try:
        from tools import report
        page = report.write_report(run_dir)
        print(f"  report: {page}")
        return page
    except Exception as e:
        print(f"whale: warning: report.html not written ({type(e).__name__}: {e}); "
              f"retry with python tools/report.py {run_dir}", file=sys.stderr)
        return None
