"""harness_search/: what phase B (meta_harness.py) stands on: the proposers, and the archive.

- proposers.py: who writes candidates (`make_proposer`): primitives (offline, the default;
  primitives.py), the policy model itself, any OpenAI-compatible endpoint, or a coding agent run
  in a jailed copy of the archive (agent_proposer.py; the jail is jail/agent_jail.py);
- archive_view.py: what an LLM proposer is shown of the archive (leaderboard, diffs, traces);
- harness_archive.py: the archive's files on disk (candidates, scores, traces, the ledger) and
  the packed record of a finished run; harness_source.py: harness code read as text (its
  names, splicing one axis, the static check).

What it promises the method: a proposer reads only the archive (harness-split scores, traces,
sources), never reference answers or the test split; selection trusts only the parent's ledger.
What it leaves out: the search loop and its acceptance test (meta_harness.py).
"""
