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


def keep_freed_memory():
    """glibc returns every freed block over 32 MB (a prefill's activations, the update's logits) to
    the kernel, and the next one comes back as fresh pages the kernel must fault in and zero: 2 of
    the first run's 15 minutes. Keeping blocks under 1 GB in the heap reuses them (the same peak RSS;
    tools/bench.py --only malloc measures it: 1.09x on long prompts). Not glibc, or a GLIBC_TUNABLES
    or MALLOC_* in the environment (even empty: the user's own malloc settings): nothing changes."""
    if "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: only blocks over 1 GB are mapped apart
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GB of free heap top

