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


def measure(ctx, harness, examples, n, split, desc, also=None) -> dict:
    """rollout.evaluate of (the engine's weights, harness) at the split's seeds, with a bar (`also`:
    the run's bar, for the evaluations it counts), and its per-question means (for paired gains) in
    place of the records."""
    with rollout.bar(ctx.engine, len(examples) * n, desc, also) as bar:
        res = rollout.evaluate(ctx.engine, ctx.domain, harness, examples, n, seed=(ctx.args.seed, split),
                               sampling=ctx.sampling, max_tokens=ctx.args.max_tokens, progress=bar)
    res["per_example"] = rollout.per_example_means(res.pop("records"))
    return res


def evaluate_and_log(run, ctx, split, examples, n, tag, harness=None):
    """mean@n of (current weights, harness) on examples; logged and kept in the state. The initial
    test evaluation of (model, h0) is the same for every method of a domain and seed: cached."""
    args, state = ctx.args, run.state
    harness = harness or state["harness"]
    key = rd.eval_key(vars(args), ctx.domain, harness, examples, n, split) if tag == "initial" else None
    res = rd.load_cached_eval(key)
    counted = split == "test" and tag in ("initial", "final", "best_val")  # (the run's bar counts the full tests)
    if res is None:
        res = measure(ctx, harness, examples, n, split, f"eval {split} mean@{n}", also=run.bar if counted else None)
        rd.store_cached_eval(key, res)
    elif counted:
        run.bar.update(len(examples) * n)  # (cached: done at once)
    rd.crash_point("eval")  # (a testing aid: a kill after an evaluation, before its line and checkpoint)
    point = {"split": split, "tag": tag, "cycle": state["cycle"], "rollouts": state["rollouts"],
             **{k: res[k] for k in ("mean", "se", "n", "examples")}}
    if split == "test":
        point["per_example"] = res["per_example"]
    state["evals"].append(point)
    run.log({"event": "eval", **point, "seconds": round(res["seconds"], 1)},
            console=f"eval {split} ({tag}): mean@{n} {res['mean']:.3f} ± {res['se']:.3f} on {res['examples']} "
                    f"questions, {res['seconds']:.0f} s")
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
    tests = {e["tag"]: e for e in state["evals"] if e["split"] == "test"}
    run.bar.total = run.bar.n + len(ctx.test) * args.test_n * len(tests_ahead(run, ctx, tests))  # (all that is left)
    run.bar.refresh()
    if ctx.method is not None and "final" not in tests:
        tests["final"] = evaluate_and_log(run, ctx, "test", ctx.test, args.test_n, "final")
        run.checkpoint(ctx.engine, ctx.optimizer, model_changed=False)
    # nothing trains after the final test: AdamW's state (2x the trained weights) leaves memory before the
    # 2 x 2 loads the base weights beside the final ones (the checkpoint keeps its file until drop_optimizer)
    ctx.optimizer.state.clear()
    if ctx.method is not None and args.two_by_two == "on" and both_moved(run, ctx):  # the final weights: in the engine now
        test_cell(run, ctx, "final_weights_h0", ctx.h0)
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
    cells = two_by_two(run, ctx, initial, final) if ctx.method is not None and args.two_by_two == "on" else None
    run.bar.close()
    rd.plot_curve(run.dir, state["evals"], f"{args.method} on {args.domain} (seed {args.seed})")
    gain = rollout.paired_gain(initial["per_example"], final["per_example"])  # final - initial, paired
    run.print_summary(run.write_summary(tests, best_val_test, gain, cells))
    run.finish_tracker(write_report(run.dir))
    run.drop_optimizer()  # nothing trains after this: the run directory keeps only weights, state and records


def tests_ahead(run, ctx, tests) -> list[str]:
    """The full-test evaluations finish() still has to score (the run's bar counts them): the final
    test, the best-on-validation point when it is an earlier one, and the 2 x 2's two new cells."""
    if ctx.method is None:
        return []
    state, best = run.state, run.state["best_val"]
    ahead = [] if "final" in tests else ["final"]
    if best is not None and best["tag"] != "initial" and "best_val" not in tests and not (
            best["rollouts"] == state["rollouts"] and best["harness"] == state["harness"]):
        ahead.append("best_val")
    if ctx.args.two_by_two == "on" and both_moved(run, ctx):
        ahead += [c for c in ("final_weights_h0", "base_weights_final_harness") if c not in state.get("two_by_two", {})]
    return ahead


def write_report(run_dir):
    """report.html beside the run's files (rundir/report.py); its path, or None. The page is a view of
    the files: if it breaks, the run is still whole, and the warning says how to write it again."""
    try:
        from rundir import report
        page = report.write_report(run_dir)
        print(f"  report: {page}")
        return page
    except Exception as e:
        print(f"whale: warning: report.html not written ({type(e).__name__}: {e}); "
              f"retry with python tools/report.py {run_dir}", file=sys.stderr)
        return None


# -----------------------------------------------------------------------------
# The run's own 2 x 2 (--two-by-two): the paper's claim inside one run

def test_cell(run, ctx, tag, harness):
    """One cell of the 2 x 2 on the test questions at the test's own seeds (so it pairs with the initial
    and final evaluations draw for draw): the weights now in the engine under `harness`. Kept in the
    state's two_by_two (a resumed run does not score it again) and logged as a `two_by_two` event."""
    cells = run.state.setdefault("two_by_two", {})
    if tag not in cells:
        res = measure(ctx, harness, ctx.test, ctx.args.test_n, "test", f"2x2 {tag}", also=run.bar)
        cells[tag] = {k: res[k] for k in ("mean", "se", "per_example")}
        run.log({"event": "two_by_two", "cell": tag, "mean": res["mean"], "se": res["se"],
                 "seconds": round(res["seconds"], 1)}, console=f"2x2: {tag.replace('_', ' ')} {res['mean']:.3f}")
        run.checkpoint(ctx.engine, ctx.optimizer, model_changed=False)
    return cells[tag]


def both_moved(run, ctx) -> bool:
    """Did the run change its weights and its harness? (Only then are two cells of the 2 x 2 new.)"""
    return run.state["counters"].get("optimizer_steps", 0) > 0 and run.state["harness"] != ctx.h0


def two_by_two(run, ctx, initial, final) -> dict:
    """Final test mean@k of {base, final weights} x {starting, final harness} on the same questions, and
    what each half did, paired per question: weights alone (final weights, starting harness - initial),
    harness alone (base weights, final harness - initial), together (final - initial) and the
    interaction (together minus the two alone). A cell that is another cell (nothing trained, or the
    harness unchanged) is not scored again. Costs up to two test evaluations; the engine ends with the
    base weights (the run's checkpoints are on disk)."""
    state, args = run.state, ctx.args
    trained, searched = state["counters"].get("optimizer_steps", 0) > 0, state["harness"] != ctx.h0
    fw_h0 = test_cell(run, ctx, "final_weights_h0", ctx.h0) if trained and searched else (final if trained else initial)
    if trained and searched:
        if "base_weights_final_harness" not in state.get("two_by_two", {}):
            from lm import models
            base, _ = models.load_model(args.model, device=run.device)  # --model: the base, also on a resume
            ctx.engine.model.load_state_dict(base.state_dict())  # (vLLM: its sync_weights sends them on)
            ctx.engine.sync_weights()
            del base
        bw_fh = test_cell(run, ctx, "base_weights_final_harness", state["harness"])
    else:
        bw_fh = final if searched else initial
    b, f = initial["per_example"], final["per_example"]
    fw, bh = fw_h0["per_example"], bw_fh["per_example"]
    both = [q for q in b if q in f and q in fw and q in bh]
    out = {"base_h0": initial["mean"], "base_weights_final_harness": bw_fh["mean"], "final_weights_h0": fw_h0["mean"],
           "final": final["mean"], "questions": len(both)}
    for name, d in (("weights_alone", {q: fw[q] - b[q] for q in both}), ("harness_alone", {q: bh[q] - b[q] for q in both}),
                    ("together", {q: f[q] - b[q] for q in both}),
                    ("interaction", {q: f[q] - fw[q] - bh[q] + b[q] for q in both})):
        out[name], out[name + "_se"] = rollout.paired_gain(dict.fromkeys(d, 0.0), d)
    return out
