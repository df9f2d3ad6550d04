"""
The process settings a run makes before torch loads (whale.py calls tune_process first): how
OpenMP's threads wait, and where glibc puts freed memory. Both are measured speed settings, not
method; a setting the user made in the environment is always theirs.
"""
import os


def tune_process():
    """OpenMP's wait (spin briefly, then sleep) and glibc's freed memory (kept in the heap)."""
    # OpenMP threads wait for the next parallel region by spinning briefly, then sleeping: 20,000 spins.
    # Sleeping at once (OMP_WAIT_POLICY=PASSIVE) costs a futex wake-up per region, and a decode step has
    # hundreds: 1.3x the time of an evaluation; spinning long (libgomp's default) would take the cores from
    # the sandbox child and from a second run (tools/bench.py --only omp measures it).
    if "OMP_WAIT_POLICY" not in os.environ:  # (a policy the user sets is theirs)
        os.environ.setdefault("GOMP_SPINCOUNT", "20000")
    keep_freed_memory()


def _libc_unless_user_tuned():
    """glibc, or None: not glibc, or the user's own malloc settings (GLIBC_TUNABLES, MALLOC_*)."""
    if "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return None
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory():
    """glibc returns every freed block over 32 MB (a prefill's activations, the update's logits) to
    the kernel, and the next one comes back as fresh pages the kernel must fault in and zero: 2 of
    the first run's 15 minutes. Keeping blocks under 1 GB in the heap reuses them (the same peak RSS;
    tools/bench.py --only malloc measures it: 1.09x on long prompts). Not glibc, or a GLIBC_TUNABLES
    or MALLOC_* in the environment (even empty: the user's own malloc settings): nothing changes."""
    libc = _libc_unless_user_tuned()
    if libc is not None:
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: only blocks over 1 GB are mapped apart
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GB of free heap top


def give_freed_memory_back():
    """--max-memory: what the heap keeps counts against the limit, so the trade above flips. After
    phase A's update (its activations and gradients freed) the process's RSS stayed at the update's
    peak through the next rollouts, with the sandbox's children on top (run 15: 3,980 MB beside
    4,214 for the process tree). Blocks over 32 MB are mapped apart again and given back when freed,
    and what is free now goes back at once (malloc_trim): more page faults later, no number changes."""
    libc = _libc_unless_user_tuned()
    if libc is not None:
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's own largest
        libc.mallopt(-1, 32 << 20)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)

