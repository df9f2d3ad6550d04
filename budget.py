"""budget.py: what the budget of target rollouts buys, in one place.

Every method compared spends the same number of target rollouts (--budget). whale.py asks
Budget, after each RSFT step and before each harness iteration, whether the next unit of work
still fits; a switch policy (switch.py) decides only when a phase is done by its own signals.
Left out: how rollouts are booked (run_dir.Run.spend) and anything that is not a target rollout.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """The run's budget of target rollouts, the same for every method, and what buys what.

    Counted:   an RSFT step costs step_cost = prompts_per_step x group rollouts; a harness
               candidate costs candidate_cost = search-set examples x harness_n, an iteration
               up to `candidates` of them (the incoming harness, iteration 0, is one candidate).
    Reserved:  a harness phase that a weight phase follows leaves one step_cost for it.
    Not counted: the one-rollout check that a proposed candidate runs at all (validate_run),
               every evaluation (initial, validation, test subset, final, best-on-val: they
               measure the agent, the same way for every method), and the proposer's own
               calls (summary.json counts those apart: proposer_calls, tokens, dollars).
    What was spent is the state's `rollouts` (Run.spend books it after each step and phase)
    plus, inside a harness phase, the rollouts its archive records (meta_harness.spent_rollouts)."""
    total: int           # --budget
    step_cost: int       # one RSFT step
    candidate_cost: int  # one harness candidate on the search set
    candidates: int      # --candidates: per harness iteration

    def iteration_cost(self) -> int:
        return self.candidates * self.candidate_cost

    def reserve(self, weights_follow: bool) -> int:
        return self.step_cost if weights_follow else 0

    def step_fits(self, spent: int) -> bool:
        """Does the budget buy another RSFT step?"""
        return self.total - spent >= self.step_cost

    def cycle_fits(self, spent: int) -> bool:
        """Does it buy a harness iteration and a weight step after it (else a weight phase runs to the end)?"""
        return self.total - spent >= self.iteration_cost() + self.step_cost

    def candidates_affordable(self, spent: int, weights_follow: bool, phase_left: int | None = None) -> int:
        """Candidates the next harness iteration may propose: up to `candidates`, fewer at the end
        (of the budget, or of the phase's own allowance when it has one: phase_left rollouts)."""
        left = self.total - spent - self.reserve(weights_follow)
        if phase_left is not None:
            left = min(left, phase_left)
        return max(0, min(self.candidates, left // self.candidate_cost))

    def phase_allowance(self, iterations: int) -> int:
        """--harness-length rollouts: a harness phase of `iterations` iterations (the incoming harness's
        included) at full evaluation. A candidate racing drops early, or one the evaluation cache
        already scored, leaves its unspent rollouts to further candidates of the same phase."""
        return self.candidate_cost + (iterations - 1) * self.iteration_cost()

    def weight_share(self, policy, steps_per_epoch: int) -> float:
        """The share one fixed WHALE cycle spends on weights (weight steps against the incoming
        harness plus I-1 iterations); the stagewise baseline spends that share first, then the
        rest on harness search. An adaptive policy has no fixed length: half and half."""
        import switch  # (switch.py knows nothing of budgets; only this share reads a policy's length)
        if not isinstance(policy, switch.Fixed):
            return 0.5
        a_cost = policy.weight_steps(steps_per_epoch) * self.step_cost
        return a_cost / (a_cost + self.candidate_cost + (policy.I - 1) * self.iteration_cost())
