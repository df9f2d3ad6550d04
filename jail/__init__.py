"""jail/: where code the method does not trust runs, and how files it did not make are read.

- sandbox.py + sandbox_child.py: a harness file runs over many rollouts, each in a locked-down
  process of its own forked by one child (the parent side, and the code inside the child);
- agent_jail.py: the proposer's coding agent (`--proposer command`) in a cell of its own;
- isolation.py: the kernel mechanics both share (namespaces, tmpfs covers, the uid drop, rlimits,
  seccomp); landlock.py: the Landlock rule sets;
- received.py: reading what someone else made (a run directory, run.zip, bundle, endpoint reply):
  paths inside, no links followed, sizes and times capped.

What it promises the method: a harness sees its task, llm() and its tools and nothing else (not
the reference answers, the other splits, the run directory, the repository or another rollout),
and cannot end or stall the run; an agent writes only into its copy of the archive and reaches the network only
through the parent's allowlisting proxy. sandbox.py's and agent_jail.py's docstrings hold the
layers, the attacks tried and what each layer leaves out (a kernel exploit, side channels).
Nothing here imports the method's files.
"""
