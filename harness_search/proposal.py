"""
proposal.py: what one call of any proposer returns, and nothing else.

Every proposer (primitives.py, the LLM proposers in proposers.py, agent_proposer.py) returns a
Proposal, and meta_harness.search_phase books it with the iteration. It has a file of its own so
that the proposers and the search import it from below, not from one another.
"""
from typing import NamedTuple


class Proposal(NamedTuple):
    """What one proposer call returns (meta_harness.py books it with the iteration)."""
    candidates: list          # dicts: source, proposer, note, [parent, axis, format, finish, reject, raw]
    errors: list = []         # what went wrong in this call, one sentence each
    exhausted: bool = False   # nothing left to propose on this archive (the next call would say the same)
    usage: dict = {}          # this call's cost: calls, prompt/completion chars and tokens, seconds, cost_usd
