"""switch.py: when to change phase.

WHALE alternates phase A (weights: RSFT rollout steps) and phase B (harness:
Meta-Harness iterations). A switch policy answers two questions, and nothing else:

  policy.weight_done(rewards, steps_per_epoch, val_means) -> bool
      asked after each phase-A rollout step; `rewards` is this phase's per-step
      mean training reward so far (one float per step, oldest first).
  policy.harness_done(paper_successes, val_means) -> bool
      asked after each phase-B iteration; `paper_successes` is the success of the
      paper's choice (the archive's top scorer) after each iteration so far. The
      incoming harness's evaluation is iteration 1, so paper_successes[0] is its score.
  val_means: the run's validation mean@k so far, one per evaluation (the initial one
      and one after each phase, oldest first). A policy of your own may read it (e.g.
      switch on a validation plateau); any object with these two methods will do.
  policy.val_every (optional, default 0): a policy that reads val_means inside a
      weight phase asks for a validation every val_every RSFT steps (0: only between
      phases); the run evaluates at the shorter of this and --val-every.

Two policies, as in the paper (parse_schedule reads the --schedule spelling):
  Fixed(E, I)  --schedule fixed:E,I or fixed-steps:E_steps,I.
               E = weight-phase length in epochs of the weight pool (or E_steps
               rollout steps), I = harness iterations incl. the incoming eval.
               Paper's main setting (0.6, 6), best fixed (0.2, 6).
  Patience     --schedule adaptive[:w=..]: the paper's adaptive switching.
               Weight side: stop when the W-step moving average of the training
               reward has not set a new strict phase-best for P_w steps, after at
               least M steps (W = P_w = M = 0.2 epoch). Harness side: stop when the
               paper's choice's score has not strictly improved for P_h = 2 iterations,
               after at least 6 iterations, and always at 15.
               The paper's launcher only wires the harness side; we wire both.

Leaves out: budgets (budget.py says what the rollout budget buys, and the loop
ends a phase when it runs out, so phase A has no cap of its own here), I/O,
logging, and any held-out signal: both policies here look at training signals
only (they ignore val_means), so switching never peeks at held-out data. A policy
that reads val_means chooses with the validation split, never the test split.
"""

import math
from dataclasses import dataclass, fields

# A new best must beat the old one by more than float rounding: the mean of three
# 0.1s is 0.10000000000000002, which must not count as progress on a flat curve.
# Real rewards are means over thousands of binary rollouts, so any true change
# is many orders of magnitude larger than this.
TOL = 1e-9


def epochs_to_steps(epochs: float, steps_per_epoch: int) -> int:
    """Round half up (not Python's round-half-even), never below 1 step."""
    if not (isinstance(steps_per_epoch, int) and steps_per_epoch >= 1):
        raise ValueError(f"steps_per_epoch must be an int >= 1, got {steps_per_epoch!r}")
    return max(1, math.floor(epochs * steps_per_epoch + 0.5 + TOL))


def smoothed(rewards: list[float], window: int) -> list[float]:
    """smoothed[t] = mean(rewards[t-window+1 .. t]), over what exists when t < window."""
    return [math.fsum(rewards[max(0, t - window + 1): t + 1]) / (t + 1 - max(0, t - window + 1))
            for t in range(len(rewards))]


def stale(values: list[float], patience: int) -> bool:
    """True iff none of the last `patience` values set a new strict best.

    The best is over `values` only (a phase's own curve): the first value always
    sets one, so a list needs more than `patience` entries to be stale."""
    if len(values) <= patience:
        return False
    return max(values[-patience:]) <= max(values[:-patience]) + TOL


@dataclass(frozen=True)
class Fixed:
    E: float | None = None       # weight phase in epochs of the weight pool ...
    I: int = 6                   # harness iterations, incoming evaluation included
    E_steps: int | None = None   # ... or directly in rollout steps (exactly one of E, E_steps)

    def __post_init__(self):
        if (self.E is None) == (self.E_steps is None):
            raise ValueError("Fixed needs exactly one of E (epochs) or E_steps (steps)")
        if self.E is not None and not (math.isfinite(self.E) and self.E > 0):
            raise ValueError(f"Fixed: E must be a finite number of epochs > 0, got {self.E!r}")
        if self.E_steps is not None and not _pos_int(self.E_steps):
            raise ValueError(f"Fixed: E_steps must be an int >= 1, got {self.E_steps!r}")
        if not _pos_int(self.I):
            raise ValueError(f"Fixed: I must be an int >= 1, got {self.I!r}")

    def weight_steps(self, steps_per_epoch: int) -> int:
        if self.E_steps is not None:
            return self.E_steps
        return epochs_to_steps(self.E, steps_per_epoch)

    def weight_done(self, rewards: list[float], steps_per_epoch: int, val_means: list[float] = ()) -> bool:
        return len(rewards) >= self.weight_steps(steps_per_epoch)

    def harness_done(self, paper_successes: list[float], val_means: list[float] = ()) -> bool:
        return len(paper_successes) >= self.I


@dataclass(frozen=True)
class Patience:  # --schedule adaptive
    # Weight side, in rollout steps; None = 0.2 epoch of the weight pool (paper).
    w: int | None = None      # moving-average window
    pw: int | None = None     # steps without a new strict smoothed best
    min_w: int | None = None  # minimum phase length
    # Harness side, in iterations (the incoming evaluation is iteration 1).
    ph: int = 2
    min_h: int = 6
    max_h: int = 15

    def __post_init__(self):
        for f in fields(self):  # None is allowed only where it means "0.2 epoch"
            v = getattr(self, f.name)
            if not (_pos_int(v) or (v is None and f.default is None)):
                raise ValueError(f"Patience: {f.name} must be an int >= 1, got {v!r}")
        if self.min_h > self.max_h:
            raise ValueError(f"Patience: min_h={self.min_h} exceeds max_h={self.max_h}")

    def weight_done(self, rewards: list[float], steps_per_epoch: int, val_means: list[float] = ()) -> bool:
        default = epochs_to_steps(0.2, steps_per_epoch)
        w, pw, min_w = (default if v is None else v for v in (self.w, self.pw, self.min_w))
        # Smooth first: one lucky batch moves a W-step mean by only 1/W of its
        # luck, so it rarely resets patience unless the trend is really rising.
        return len(rewards) >= min_w and stale(smoothed(rewards, w), pw)

    def harness_done(self, paper_successes: list[float], val_means: list[float] = ()) -> bool:
        n = len(paper_successes)
        return n >= self.max_h or (n >= self.min_h and stale(paper_successes, self.ph))


def _pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


USAGE = ('expected "fixed" (= fixed:0.6,6), "fixed:E,I" (E epochs > 0, I int >= 1), '
         '"fixed-steps:S,I" (S steps int >= 1), "adaptive", or '
         '"adaptive:w=..,pw=..,min_w=..,ph=..,min_h=..,max_h=.." (ints >= 1, any subset)')


def check(args, method, weight_pool_size: int | None) -> str | None:
    """What is wrong with --schedule for this run, as a sentence (None: nothing): it must parse, and
    an adaptive weight phase's minimum length must leave room in --budget for a harness phase
    (weight_pool_size None: the parse only). rundir/run_setup.py calls it before a run starts."""
    try:
        policy = parse_schedule(args.schedule)
    except ValueError as e:
        return str(e)
    if getattr(args, "harness_length", "iterations") == "rollouts" and not isinstance(policy, Fixed):
        return (f"--harness-length rollouts sizes a fixed schedule's harness phase (its I iterations' rollouts); "
                f"--schedule {args.schedule} counts iterations: drop one of the two")
    if weight_pool_size is None or not (method and method.weights_until == "switch" and isinstance(policy, Patience)):
        return None
    step = args.prompts_per_step * args.group
    min_w = policy.min_w or epochs_to_steps(0.2, max(1, weight_pool_size // args.prompts_per_step))
    if min_w * step < args.budget:
        return None
    return (f"--schedule {args.schedule}: the first weight phase lasts at least {min_w} steps ({min_w * step} "
            f"rollouts, 0.2 epoch unless min_w is given), the whole --budget {args.budget}, so no harness phase "
            f"would run; scale it, e.g. adaptive:w=2,pw=2,min_w=2")


# --schedule NAME[:key=value,...]: a policy whose options are its dataclass fields (ints), by name. A policy of
# your own (a frozen dataclass with weight_done and harness_done, fields with defaults) is one line here.
BY_NAME = {"adaptive": Patience}


def val_every(policy, flag: int) -> int:
    """RSFT steps between validations inside a weight phase (0: none): the shorter of --val-every
    (`flag`) and what the policy asks for (its optional val_every), so that a policy that reads
    val_means within a phase gets fresh ones without the user's flag."""
    return min((n for n in (flag, getattr(policy, "val_every", 0)) if n), default=0)


def parse_schedule(text: str):
    """CLI string -> policy, e.g. "fixed:0.6,6", "fixed-steps:3,4", "adaptive:ph=3"."""
    kind, _, args = text.strip().partition(":")
    kind, args = kind.strip().lower(), args.strip()
    try:
        if kind == "fixed" and not args:
            return Fixed(0.6, 6)
        if kind in ("fixed", "fixed-steps"):
            parts = [p.strip() for p in args.split(",")]
            if len(parts) != 2:
                raise ValueError(f"{kind} takes two values, got {len(parts)}")
            if kind == "fixed":
                return Fixed(E=float(parts[0]), I=int(parts[1]))
            return Fixed(E_steps=int(parts[0]), I=int(parts[1]))
        if kind in BY_NAME:
            kwargs = {}
            for item in filter(None, (p.strip() for p in args.split(","))):
                key, eq, val = (s.strip() for s in item.partition("="))
                if not eq or key not in {f.name for f in fields(BY_NAME[kind])} or key in kwargs:
                    raise ValueError(f"bad or repeated option {item!r}")
                kwargs[key] = int(val)
            return BY_NAME[kind](**kwargs)
        raise ValueError(f"unknown schedule kind {kind!r}")
    except ValueError as e:  # int("6.5") etc. land here too: say what was wrong and what works
        raise ValueError(f"bad schedule {text!r}: {e}; {USAGE}") from None
