"""
WHALE: Weight-Harness Alternating LEarning (arXiv 2609.00196), the whole loop in one file.

An LLM agent is its weights plus its harness (the code that builds prompts, calls tools,
parses answers and decides when to stop). WHALE improves both, alternating
  phase A (rs_sft.py)        roll out under the current harness, keep the verified rollouts,
                             fine-tune on the model's own tokens;
  phase B (meta_harness.py)  a proposer (harness_search/) writes new harness files from an
                             archive of candidates, scores and traces; the incumbent (the
                             candidate a paired sign test kept) carries on;
and switch.py decides when to change phase. Every method spends the same budget of target
rollouts (budget.py says what it buys); METHODS below says, as data, what each one does with it.

    python whale.py --domain searchqa                  # WHALE on the embedded model
    python whale.py --domain math --method weight-only
    python whale.py --resume runs/searchqa-whale-s0    # continue after a crash

The run's bookkeeping (run directory, checkpoints, metrics.jsonl, resume, command-line checks,
the DDP plumbing) is rundir/; how it is scored (initial test, validation after each phase,
best-on-val, final test) is evaluation.py; the sampler and model loading are lm/. Left out on
purpose: multi-node training and asynchronous rollouts. Data-parallel phase A runs under torchrun (see README).
"""
from lm.process_tuning import tune_process

tune_process()  # (plumbing: OpenMP's wait and glibc's freed memory, set before torch loads)
import importlib
import sys
import types
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from budget import Budget  # what the rollout budget buys: the loop asks it when a phase must end
from rundir.run_setup import RunFinished, UserError, open_run, parse_args  # every command-line mistake, found before the loop


def arg(default, help):
    return field(default=default, metadata={"help": help})


# Named sets of flags (--preset NAME): each one a whole run of any method at a size for its purpose; flags given
# beside it win. "tiny" is about a minute on a 2-core CPU: a smoke test, a fork's first try, and the tests'
# own tiny runs (tests/helpers.py's TINY is `--preset tiny`).
PRESETS = {
    "tiny": dict(budget=32, prompts_per_step=2, group=4, candidates=2, harness_examples=4, harness_n=1, test_limit=4,
                 test_n=2, val_limit=2, val_n=1, max_tokens=32, temperature=0.3, schedule="fixed-steps:1,2",
                 train_layers=1, lr=3e-4, max_kept_per_prompt=2),
}


@dataclass
class Args:
    domain: str = arg("searchqa", "task family: domains/<name>.py (searchqa, math, chess; template: the example to copy)")
    preset: str = arg("", "a named set of flags (PRESETS): tiny = a whole run of any method in about a minute on a "
                          "2-core CPU (a smoke test); flags given beside it win")
    method: str = arg("whale", "whale | fst | weight-only | harness-only | stagewise | eval")
    schedule: str = arg("fixed-steps:3,3", "switch policy: fixed:E,I (epochs) | fixed-steps:S,I | adaptive[:w=..] "
                                           "(I counts the incoming harness: 3 = two proposer iterations)")
    harness_length: str = arg("iterations", "a fixed schedule's harness phase lasts I iterations, or, with rollouts, "
                                           "the rollouts I iterations cost at full evaluation (1 + (I-1) x "
                                           "--candidates candidates): what racing saves buys more candidates")
    budget: int = arg(1408, "total target rollouts (phase A + phase B), the same for every method (the default "
                            "buys 3 + 4 RSFT steps of 128 and one harness phase of 1 + 2 x 3 candidates x 64; "
                            "run 18: 21.8 min alone on 2 cores at 200 fp32 matmul GFLOP/s, its 2 x 2 included, "
                            "peak memory 4.0 GB: results/first-run/; times scale with 1/GFLOP/s)")
    seed: int = arg(0, "seed for data order, sampling and proposals")
    out: str = arg("", "run directory (default runs/<domain>-<method>-s<seed>)")
    resume: str = arg("", "continue the run in this directory from its last checkpoint")
    tracker: str = arg("none", "also log to none | tensorboard | mlflow | wandb, or a comma list (tracking.py); "
                               "on --resume, a given --tracker replaces the run's own")
    model: str = arg("embedded", "'embedded' (SmolLM2-135M-Instruct), an HF id, a local dir or a .gguf file")
    chat_format: str = arg("auto", "auto | template | plain: the tokenizer's chat template or plain "
                                   "'User: ...\\n\\nAssistant:' turns (auto: plain if the model has none)")
    engine: str = arg("hf", "sampler: hf (plain PyTorch loop) or vllm")
    device: str = arg("cpu", "cpu or cuda")
    rollout_precision: str = arg("fp32", "fp32 | int8: sample rollouts from an int8 copy of the model (CPU, hf "
                                         "engine; training stays fp32; README: Speed)")
    tp: int = arg(1, "vLLM tensor parallelism: GPUs per sampling engine (--engine vllm)")
    max_memory: float = arg(-1.0, "GB of RAM this run's process may use: sizes the hf sampler's batches to fit "
                                  "beside the weights and optimizer state (lm/engine.fit_to_memory: the same tokens) "
                                  "and a training forward's positions (rs_sft.within_tokens: the same update up to "
                                  "the order of its sums); -1 = auto: 4 on a CPU run when the model fits (the first "
                                  "run peaks at 4.0 GB), else none; 0 = no limit (the sampler's fixed caps: faster)")
    harness: str = arg("", "start from this harness file instead of the domain's h0")
    # phase A
    prompts_per_step: int = arg(16, "B: prompts per rollout step")
    group: int = arg(8, "G: rollouts per prompt")
    lr: float = arg(1e-5, "AdamW learning rate (phase-A study: 1e-5 with full fine-tuning learns at 135M; "
                          "README: picking --lr for another model)")
    minibatch: int = arg(16, "sequences per optimizer step")
    micro_batch: int = arg(8, "sequences per forward/backward (gradient accumulation)")
    sft_prompts: str = arg("shared", "shared | whole: run the prompt tokens a micro-batch's sequences share once "
                                     "(lm/prefix_tree.py: the same loss up to round-off), or every sequence "
                                     "whole (rs_sft's reference path)")
    clip: float = arg(1.0, "gradient-norm clip")
    train_layers: int = arg(0, "train only the top K blocks (0 = full fine-tuning: the phase-A study's regime)")
    max_kept_per_prompt: int = arg(4, "at most this many kept rollouts per prompt (0 = all; 4: the study's)")
    replay_steps: int = arg(1, "R: each RSFT step trains on the kept rollouts of the last R steps")
    sft_epochs: int = arg(1, "E: passes of each RSFT step over its kept rollouts")
    val_every: int = arg(0, "also evaluate validation (+ --test-subset) every N RSFT steps (0 = after each phase)")
    # phase B
    proposer: str = arg("primitives", "primitives | self | openai | command")
    proposer_ties: str = arg("older", "primitives proposer: on a tie for the top score, edit the older candidate "
                                      "(the paper's order) or the newer (sideways moves across a plateau: "
                                      "harness_search/primitives.parent_of)")
    proposer_merge: str = arg("on", "primitives proposer: on = each proposal starts with a merge of the best with "
                                    "what other lineages changed where it held or helped (primitives.merges); off")
    proposer_url: str = arg("", "openai proposer: base URL of an OpenAI-compatible endpoint")
    proposer_model: str = arg("", "openai proposer: model name")
    proposer_command: str = arg("", "command proposer: the coding agent CLI, run jailed in a copy of the archive "
                                    "with the prompt on stdin (README: claude -p and codex exec)")
    proposer_max_tokens: int = arg(4096, "self/openai proposer: reply length limit in tokens")
    proposer_timeout: float = arg(0.0, "seconds per openai request (0 = 600) or per agent run (0 = 1800)")
    proposer_api_key_env: str = arg("OPENAI_API_KEY", "openai proposer: the variable holding the API key")
    proposer_format: str = arg("any", "self/openai proposer: reply with a whole file, edit blocks, or either "
                                      "(file | edit | any)")
    proposer_digest_chars: int = arg(16000, "LLM and command proposers: characters of the archive view in the prompt")
    proposer_hosts: str = arg("api.anthropic.com,api.openai.com", "command proposer: the hosts its agent may reach "
                              "(HTTPS on port 443 through the jail's egress proxy; a comma list, *.domain allowed)")
    proposer_env: str = arg("", "command proposer: variables its agent keeps besides PATH, HOME, LANG, TERM... "
                                "(e.g. ANTHROPIC_API_KEY); repeatable or a comma list")
    proposer_budget_usd: float = arg(0.0, "end the harness search once the proposer's reported cost reaches this "
                                          "many dollars over the whole run (0 = no cap)")
    candidates: int = arg(3, "M: candidates per harness iteration")
    harness_examples: int = arg(64, "examples of the harness search set (0 = all)")
    harness_n: int = arg(1, "rollouts per harness-search example (1 since run 17: a candidate costs half, so a "
                               "budget buys more of them; results/first-run/README.md)")
    accept_alpha: float = arg(0.2, "a candidate replaces the incumbent only if the paired sign test p <= this")
    race: str = arg("futility", "phase B scores a candidate in blocks and drops it once it has little chance "
                                "left to beat the incumbent (meta_harness.RACE; results/racing/README.md): "
                                "futility, or off to score every candidate on every example")
    confirm_examples: int = arg(64, "second look: a near-miss top candidate (p in (alpha, 0.5]) is scored on this "
                                    "many further harness-split examples and tested on both blocks (0 = none)")
    # sampling and evaluation
    temperature: float = arg(0.7, "sampling temperature (training, search, evaluation): the phase-A study's "
                                  "0.7; the paper's 1.0 suits 2B models, the 135M model scores ~0 there")
    top_k: int = arg(20, "top-k of sampling")
    top_p: float = arg(1.0, "top-p of sampling")
    max_tokens: int = arg(48, "cap on new tokens per llm() call (the parent enforces it)")
    test_n: int = arg(8, "samples per test question: mean@test_n")
    test_limit: int = arg(100, "first N test questions (0 = all 250)")
    two_by_two: str = arg("on", "on: the final test also scores (final weights, starting harness) and (base weights, "
                                "final harness) on the same questions: what each half did and their interaction "
                                "(up to 2 more test evaluations, only when both moved); off")
    test_split: str = arg("test", "the split scored as 'test': test, or val to choose settings without "
                                  "ever reading the test split")
    val_n: int = arg(2, "samples per validation question")
    val_limit: int = arg(16, "validation questions evaluated after every phase (0 = all; 16: results/first-run/)")
    test_subset: int = arg(0, "also evaluate this many test questions after every phase (curves)")


# -----------------------------------------------------------------------------
# The methods, as data: the loop below reads these fields and never a method's name.

@dataclass(frozen=True)
class Method:
    first: str                 # the phase a run starts in: "A" (weights) or "B" (harness)
    weights_until: str | None  # what ends a weight phase: "switch" (switch.py's policy), "share" (the
                               # method's share of the budget) or "budget" (the run's end); None: no phase A
    harness_until: str | None  # what ends a harness phase: "switch" or "budget"; None: no phase B
    prompt_only: bool = False  # FST: a candidate may change only the domain's PROMPT_AXES
    one_pass: bool = False     # the run ends with its first harness phase (no weight phase after it)


METHODS = {
    "whale":        Method("A", weights_until="switch", harness_until="switch"),
    "fst":          Method("A", weights_until="switch", harness_until="switch", prompt_only=True),
    "weight-only":  Method("A", weights_until="budget", harness_until=None),
    "harness-only": Method("B", weights_until=None, harness_until="budget", one_pass=True),
    "stagewise":    Method("A", weights_until="share", harness_until="budget", one_pass=True),
}  # --method eval runs no phase: it scores (model, --harness) on test and stops


@dataclass
class Context:
    """What the loop's phases share, fixed for the whole run (main builds it; evaluation.py reads it).
    What changes as the run goes (step, cycle, harness, rollouts spent, evaluations) is run.state
    instead: each of its keys is documented in rundir/run_dir.py's new_state; a checkpoint saves it."""
    args: Args                 # the run's settings (a resumed run keeps those it started with)
    method: Method | None      # METHODS[args.method]; None: --method eval (no phase, only the test)
    domain: types.ModuleType   # domains/<name>.py: its splits, h0, tools and verifier
    policy: object             # switch.py's policy for --schedule (weight_done, harness_done)
    pool: list                 # phase A's prompts: the weight split
    search_set: list           # phase B's scored examples: the first --harness-examples of the harness split
    confirm_set: list          # the second look's block: the next ones, at most as many
    val: list                  # the first --val-limit validation questions (after every phase)
    test: list                 # the first --test-limit questions of --test-split (initial and final)
    h0: str                    # the starting harness's source
    sampling: dict             # temperature, top_k, top_p of every rollout
    engine: object             # the sampler (lm/engine.py or lm/vllm_engine.py); .model is what trains
    steps_per_epoch: int       # RSFT steps in one pass over the weight pool
    sft: object                # rs_sft.Config (phase_a_config)
    budget: Budget             # what the rollout budget buys
    optimizer: object          # AdamW over the trained parameters
    data_parallel: tuple | None  # (rank, world, the DDP-wrapped model) under torchrun, else None


def phase_a_config(args: Args, **changes):
    """rs_sft.Config from the command line (Args holds every flag's default, the names are the same),
    with `changes` on top (main's base_model; a test's minibatch or loss_fn); Config's other fields
    keep their own defaults. A fork's loss is Config's own default loss_fn: no flag sets it."""
    import rs_sft
    settings = {f.name: getattr(args, f.name) for f in fields(rs_sft.Config) if hasattr(args, f.name)}
    return rs_sft.Config(**{**settings, **changes})


def main(args: Args):
    import switch
    from rundir.run_setup import check_args
    if not args.resume:  # a flag mistake is one line in a second, before torch is imported (open_run checks again)
        check_args(args, METHODS, switch.check)
    import evaluation
    import rs_sft
    from lm.engine import load_engine
    from rundir import ddp
    from rundir import run_dir as rd

    # new or resumed: directory, state, metrics.jsonl, DDP rank, progress bar (the checks get the method's tables)
    run = rd.Run(args, lambda a: open_run(a, METHODS, switch.check))
    args = run.args               # a resumed run keeps the settings it started with
    domain = importlib.import_module(f"domains.{args.domain}")
    splits = {s: domain.load_split(s) for s in ("weight", "harness", "val", "test")}  # checked in check_args
    engine = load_engine(run.model_path(args.model), engine=args.engine, device=run.device, tp=args.tp,
                         seed=args.seed, chat_format=args.chat_format, precision=args.rollout_precision)
    search_set = splits["harness"][:args.harness_examples or None]
    optimizer = rs_sft.make_optimizer(rs_sft.set_trainable(engine.model, args.train_layers), args.lr)
    ctx = Context(
        args=args, method=METHODS.get(args.method), domain=domain, policy=switch.parse_schedule(args.schedule),
        pool=splits["weight"], search_set=search_set,
        confirm_set=splits["harness"][args.harness_examples:][:min(args.confirm_examples, args.harness_examples)]
        if args.harness_examples else [],
        val=splits["val"][:args.val_limit or None], test=splits[args.test_split][:args.test_limit or None],
        h0=Path(args.harness or domain.H0).read_text(),
        sampling={"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p},
        engine=engine, steps_per_epoch=max(1, len(splits["weight"]) // args.prompts_per_step),
        sft=phase_a_config(args, base_model=args.model),  # (a loss's reference(): --model, not the resumed weights)
        budget=Budget(total=args.budget, step_cost=args.prompts_per_step * args.group,
                      candidate_cost=len(search_set) * args.harness_n, candidates=args.candidates),
        optimizer=optimizer, data_parallel=ddp.data_parallel(engine.model))  # (None in one process)
    run.start(rd.new_state(phase=ctx.method.first if ctx.method else "A", done=ctx.method is None, harness=ctx.h0,
                           loader=rs_sft.new_loader(len(ctx.pool), args.seed)), optimizer=optimizer, engine=engine,
              # what a checkpoint holds: the trained blocks and a pointer to the base, the whole model
              # (full fine-tuning), or no weights at all (--method eval trains nothing)
              weights="none" if ctx.method is None else "trained" if args.train_layers > 0 else "all")
    if args.max_memory:  # (plumbing: the sampler's batches and a training forward sized to the RAM left)
        ctx.sft = replace(ctx.sft, max_forward_tokens=run.fit_memory(
            engine, args.max_memory, rs_sft.training_bytes_per_position(engine.model, args.train_layers)))
    if ctx.method is not None:  # the run's bar: the budget and every full test, the 2 x 2 too (finish() makes it exact)
        tests = len(ctx.test) * args.test_n
        run.bar.total = args.budget + tests * (4 if args.two_by_two == "on" else 2)
        if run.state["pending_eval"] != "initial":
            run.bar.update(tests)  # (a resumed run: its initial test is done)

    # ---- the algorithm: initial evaluation; phase A / phase B until the budget is spent; final test
    if run.state["pending_eval"] and run.rank == 0:
        evaluation.after_phase(run, ctx)  # a new run's initial evaluation, or one a crash interrupted
    run.sync()
    while not run.state["done"]:
        if run.state["phase"] == "A":
            weight_phase(run, ctx)   # RSFT steps under the current harness (every rank) until the phase ends
        elif run.rank == 0:
            harness_phase(run, ctx)  # one Meta-Harness search from the current harness (rank 0 alone)
        if run.rank == 0:            # (also every --val-every steps: weight_phase returns with an eval pending)
            evaluation.after_phase(run, ctx)  # validation (+ test subset) mean@k; keep the best checkpoint on val
        run.sync()                   # DDP: every rank takes rank 0's state and decisions
    if run.rank == 0:
        evaluation.finish(run, ctx)


# -----------------------------------------------------------------------------
# The two phases

def weight_phase(run, ctx: Context):
    """Phase A: one RSFT rollout step after another (rollouts under the current harness ->
    keep the verified ones -> SFT on their model-written tokens) until the phase is over, or
    until a validation inside the phase is due (--val-every, or the switch policy's val_every: the
    loop evaluates and calls this again)."""
    import rollout
    import rs_sft
    import switch
    args, state = ctx.args, run.state
    every = switch.val_every(ctx.policy, args.val_every)  # validation inside the phase: 0 = none
    while state["phase"] == "A":
        with rollout.bar(ctx.engine, args.prompts_per_step * args.group // run.world,
                         f"A{state['cycle']} step {state['steps'] + 1}", run.bar, quiet=run.rank > 0) as bar:
            prompts = rs_sft.draw_prompts(ctx.pool, state["loader"], args.prompts_per_step)
            step = rs_sft.rollout_step(ctx.engine, ctx.optimizer, ctx.sft, ctx.domain, state["harness"], prompts,
                                       seed=(args.seed, "A", state["steps"]), progress=bar,
                                       data_parallel=ctx.data_parallel,  # (torchrun: this rank's slice; else None)
                                       replay=state.setdefault("replay", []))  # --replay-steps: saved with the state
        step["epoch"] = state["loader"]["epoch"]
        run.spend(step["rollouts"], prompt_tokens=step["prompt_tokens"], completion_tokens=step["completion_tokens"],
                  optimizer_steps=step["opt_steps"])
        state["steps"] += 1
        state["phase_rewards"].append(step["train_reward"])
        warnings = rs_sft.health_warnings(step, state.setdefault("capped_frac_per_step", []))
        for k in ("kept", "trained_tokens", "capped_frac"):  # what phase A had to learn from, step by step
            state.setdefault(f"{k}_per_step", []).append(step[k])
        run.log({"event": "rollout_step", "cycle": state["cycle"], "step": state["steps"], **step,
                 "step_rollouts": step["rollouts"]}, console=rs_sft.step_line(step, state["steps"], state["cycle"]))
        for w in warnings:  # a collapse is seen, not silent
            run.log({"event": "health_warning", "cycle": state["cycle"], "step": state["steps"], "warning": w,
                     "lr": args.lr, **{k: step[k] for k in ("capped_frac", "kept_nll_before", "kept_nll_after")}},
                    console=f"whale: warning: step {state['steps']}: {w}; the update is likely too large for this "
                            f"model: try a smaller --lr than {args.lr:g} (README: picking --lr)")
        if weight_phase_over(run, ctx):
            state.update(phase="B", phase_rewards=[], pending_eval=f"A{state['cycle']}")
        elif every and state["steps"] % every == 0:
            state["pending_eval"] = f"A{state['cycle']}.{state['steps']}"  # the phase goes on after this evaluation
        run.checkpoint(ctx.engine, ctx.optimizer, model_changed=True)
        if state["pending_eval"]:
            return  # every rank leaves at the same step (the same global metrics decide it)


def val_means(state) -> list[float]:
    """The run's validation mean@k so far, oldest first (what a switch policy may read)."""
    return [e["mean"] for e in state["evals"] if e["split"] == "val"]


def weight_phase_over(run, ctx: Context) -> bool:
    """Asked after every RSFT step. A weight phase ends when the budget buys no further step (the
    run ends with it, unless the method still owes its harness stage), else as the method says."""
    state, method, budget = run.state, ctx.method, ctx.budget
    if not budget.step_fits(state["rollouts"]):
        state["done"] = not (method.one_pass and method.harness_until)  # stagewise's harness stage comes next
        return True
    if method.weights_until == "budget":
        return False
    if method.weights_until == "share":
        return state["rollouts"] >= budget.weight_share(ctx.policy, ctx.steps_per_epoch) * budget.total
    if not budget.cycle_fits(state["rollouts"]):
        return False  # no room for another harness phase and a weight step after it: run to the end
    return ctx.policy.weight_done(state["phase_rewards"], ctx.steps_per_epoch, val_means=val_means(state))


def harness_phase(run, ctx: Context):
    """Phase B: a Meta-Harness search from the current harness in its own archive (it resumes from
    the archive after a crash); the search's incumbent carries on."""
    import meta_harness
    import rollout
    from harness_search import proposers
    args, state, method = ctx.args, run.state, ctx.method
    archive = run.dir / "archive" / f"phase{state['cycle']:02d}"
    hooks = search_hooks(run, ctx, archive)  # (plumbing, below: scoring, validation, budget, log)
    result = meta_harness.search_phase(
        state["harness"], ctx.domain, ctx.search_set, hooks.run_candidate, hooks.validate_run,
        proposers.from_args(args, ctx.domain, rollout.text_sampler(ctx.engine, args), run.dir),
        archive_dir=str(archive), k=args.candidates, should_stop=hooks.should_stop, affordable=hooks.affordable,
        accept_alpha=args.accept_alpha, prompt_only_base=ctx.h0 if method.prompt_only else None, log=hooks.log,
        confirm_examples=ctx.confirm_set, race=meta_harness.RACE if args.race == "futility" else None,
        run_together=lambda jobs: rollout.in_shared_batches(ctx.engine, jobs))  # an iteration's candidates
    counters = result["counters"]
    run.spend(counters.get("rollouts", 0), **{k: counters.get(k, 0) for k in (
              "proposer_calls", "proposer_prompt_tokens", "proposer_completion_tokens", "proposer_seconds",
              "proposer_cost_usd")}, harness_candidates=counters.get("candidates", 0),
              harness_invalid=counters.get("invalid", 0), harness_accepted=counters.get("accepted", 0))
    state["harness"] = result["incumbent_source"]
    (run.dir / "harnesses").mkdir(exist_ok=True)
    (run.dir / "harnesses" / f"cycle{state['cycle']:02d}.py").write_text(state["harness"])
    state.update(phase="A", cycle=state["cycle"] + 1, pending_eval=f"B{state['cycle']}", done=method.one_pass)
    run.checkpoint(ctx.engine, ctx.optimizer, model_changed=False)


# -----------------------------------------------------------------------------
# Plumbing (skip on a first read): what search_phase calls back into the run for

def search_hooks(run, ctx: Context, archive):
    """The callbacks one harness phase gives meta_harness.search_phase: run_candidate (rollouts of a
    source on search-set examples, through the run's evaluation cache), validate_run (one rollout:
    does it run at all?), affordable and should_stop (the budget, the proposer's dollars, the switch
    policy) and log (each event into metrics.jsonl, with the run's rollout count at that event)."""
    import types

    import meta_harness
    import rollout
    from harness_search import eval_cache
    from rundir.run_dir import crash_point
    args, state, method, budget = ctx.args, run.state, ctx.method, ctx.budget
    weights_follow = not method.one_pass

    def spent():  # the run's rollouts so far: those booked before this phase + this archive's candidates
        return state["rollouts"] + meta_harness.spent_rollouts(str(archive))

    # --harness-length rollouts: a fixed schedule's phase may spend what its I iterations cost at full evaluation
    allowance = budget.phase_allowance(ctx.policy.I) if (
        args.harness_length == "rollouts" and method.harness_until == "switch") else None

    def affordable():  # candidates the budget (and the phase's allowance) still pay for: the last may be fewer
        phase_left = None if allowance is None else allowance - meta_harness.spent_rollouts(str(archive))
        return budget.candidates_affordable(spent(), weights_follow, phase_left)

    def should_stop(paper_successes):  # -> why the phase ends (a sentence), or False
        if affordable() == 0 and allowance is not None and budget.candidates_affordable(spent(), weights_follow):
            return f"harness phase: its {allowance} rollouts spent, a candidate costs {budget.candidate_cost}"
        if affordable() == 0:
            return (f"budget: {budget.total - budget.reserve(weights_follow)} rollouts spent or reserved, a "
                    f"candidate costs {budget.candidate_cost}")
        usd = state["counters"].get("proposer_cost_usd", 0) + meta_harness.spent_usd(str(archive))  # earlier + this
        if args.proposer_budget_usd and usd >= args.proposer_budget_usd:
            return f"proposer budget: ${usd:.4f} of --proposer-budget-usd {args.proposer_budget_usd:g} spent"
        return (method.harness_until == "switch" and allowance is None
                and ctx.policy.harness_done(paper_successes, val_means(state)) and "switch policy: harness phase done")

    # The draws of phase B: seeded by example, not by the candidate's name, so every candidate gets the same
    # draws (a sharper sign test); and by the weights they sample from: the cycle that first searched under
    # these weights (a weight phase that kept nothing changed nothing, and the incoming harness is then a hit)
    weights_version = state["counters"].get("optimizer_steps", 0)
    seed = (args.seed, "B", state.setdefault("b_draws", {}).setdefault(str(weights_version), state["cycle"]))

    def run_rollouts(source, examples, name):  # one candidate on (some of) the search set, with its own bar
        with rollout.bar(ctx.engine, len(examples) * args.harness_n, f"B{state['cycle']} {name}", run.bar) as bar:
            records = rollout.run(ctx.engine, ctx.domain, source, examples, args.harness_n, seed=seed,
                                  sampling=ctx.sampling, max_tokens=args.max_tokens, progress=bar)
        crash_point("harness_eval")
        return records

    def validate_run(source):  # one rollout of one example: does it run at all? (its model time never decides)
        return rollout.runs_at_all(ctx.engine, ctx.domain, source, ctx.search_set[0], seed=(args.seed, "validate"),
                                   sampling=ctx.sampling, max_tokens=args.max_tokens)

    logged = {"rollouts": state["rollouts"]}  # the run's count at the last logged event of this phase

    def log(event):  # a resumed search replays its finished events: count them again, in the same order
        if event["event"] == "harness_candidate":
            logged["rollouts"] += meta_harness.candidate_rollouts(str(archive), event["cand"])
        logged["rollouts"] += event.get("confirm_rollouts", 0)  # (an iteration's second-look evaluations)
        run.log({"event": event["event"], "cycle": state["cycle"], **{k: v for k, v in event.items() if k != "event"}},
                rollouts=logged["rollouts"], console=meta_harness.console_line(event, state["cycle"]))

    return types.SimpleNamespace(
        run_candidate=eval_cache.cached(run_rollouts, run.dir / "eval_cache", weights_version, seed,
                                        dict(ctx.sampling, max_tokens=args.max_tokens), args.harness_n, archive.name),
        validate_run=validate_run, affordable=affordable, should_stop=should_stop, log=log)

if __name__ == "__main__":
    try:
        main(parse_args(Args, description=__doc__.split("\n\n")[0], presets=PRESETS))
    except RunFinished as e:
        print(f"whale: {e}")
        sys.exit(0)
    except UserError as e:
        if "tqdm" in sys.modules:  # a bar still open would be redrawn at exit on the message's line
            for bar in list(sys.modules["tqdm"].tqdm._instances):
                bar.close()
        print(f"whale: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass  # (leaving this block frees the run and its progress bar, which redraws itself: say this after it)
    else:
        sys.exit(0)
    print("whale: interrupted; `python whale.py --resume <run directory>` continues", file=sys.stderr)
    sys.exit(130)
