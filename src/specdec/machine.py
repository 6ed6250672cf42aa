"""How busy this machine is: the cores this process may use, the cores other processes
keep busy, and the thread count that leaves them alone (read by the CLI, the server and
:class:`~specdec.llm.LLM`)."""

from __future__ import annotations

import os
import time


def cores() -> int:
    """The logical CPUs this process may run on (its affinity mask; all of them elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: How long :func:`busy_cores` watches the CPUs, in seconds.
LOAD_SAMPLE_S = 0.2


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``; ``None`` where it is absent."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def busy_cores() -> float:
    """How many cores other processes keep busy now: the busy share of every CPU over
    :data:`LOAD_SAMPLE_S` seconds (``/proc/stat``) times their number, while this process
    sleeps; where ``/proc/stat`` is absent, the 1-minute load average.

    Not the load average where it can be helped: it decays over a minute, so a specdec run
    just finished (or this process's own imports) read as another process keeping the
    machine busy, and the next run dropped to fewer threads for nothing (a new user's
    back-to-back runs on 2 cores)."""
    first = _cpu_ticks()
    if first is not None:
        time.sleep(LOAD_SAMPLE_S)
        second = _cpu_ticks()
        if second is not None and second[1] > first[1]:
            share = (second[0] - first[0]) / (second[1] - first[1])
            return share * (os.cpu_count() or 1)
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


class OthersLoad:
    """Measures, as a context manager, how many cores other processes kept busy while its
    block ran: the busy time of every CPU (``/proc/stat``, VM steal included) minus this
    process's own CPU time, over the wall time.

    Attributes:
        cores_busy: that average, in cores, after the block; ``None`` where ``/proc/stat``
            is absent or the block ran under :data:`MIN_JUDGED_S` (too short for the
            kernel's 10 ms ticks to say).
    """

    #: blocks shorter than this (seconds) are not judged
    MIN_JUDGED_S = 0.5

    def __enter__(self) -> OthersLoad:
        self.cores_busy: float | None = None
        self._ticks = _cpu_ticks()
        self._own = time.process_time()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._wall
        ticks = _cpu_ticks()
        if self._ticks is None or ticks is None or wall < self.MIN_JUDGED_S:
            return
        per_second = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy = (ticks[0] - self._ticks[0]) / per_second
        own = time.process_time() - self._own
        self.cores_busy = max(0.0, busy - own) / wall


def threads_for(usual: int, cores: int, load: float) -> int:
    """PyTorch's usual thread count, lowered to the cores that other processes leave free:
    ``cores`` minus the busy ones (:func:`busy_cores`, rounded), at least 1.

    PyTorch's OpenMP threads wait for each other at the end of every operation; when one
    of them shares its core with another busy process, each small decoding step waits for
    the descheduled thread (measured on 2 cores beside one busy process: two threads ran
    10x slower than one), and a speedup printed then is fiction.

    Args:
        usual: PyTorch's own choice (one thread per physical core).
        cores: cores this process may run on (logical).
        load: cores other processes keep busy (:func:`busy_cores`).

    Example:
        >>> threads_for(2, 2, 0.1), threads_for(2, 2, 1.2), threads_for(2, 2, 3.0)
        (2, 1, 1)
        >>> threads_for(8, 16, 4.4), threads_for(8, 16, 10.0)
        (8, 6)
    """
    return max(1, min(usual, cores - round(load)))


#: Whether this process has looked at the load (:func:`warn_once_if_busy`; the CLI's
#: thread choice counts, since it says the same itself).
load_checked = False


def warn_once_if_busy(logger, threads: int) -> bool:
    """Once per process: log a warning when other processes keep busy the cores that
    ``threads`` PyTorch threads need (:func:`busy_cores`, a 0.2 s look). PyTorch's OpenMP
    threads wait for each other at the end of every operation, so a thread sharing its core
    with another busy process makes each small decoding step wait for it: generation and
    model loading can be many times slower, with nothing else to say why.

    Args:
        logger: where the warning goes.
        threads: PyTorch's thread count (``torch.get_num_threads()``).

    Returns:
        whether it warned.
    """
    global load_checked
    if load_checked or threads < 2:
        return False
    load_checked = True
    n, load = cores(), busy_cores()
    fewer = threads_for(threads, n, load)
    if fewer >= threads:
        return False
    logger.warning(
        "other processes keep this machine busy (%.1f of %d cores busy) and PyTorch's %d "
        "threads wait for each other there, which can make loading and generation many "
        "times slower: torch.set_num_threads(%d) before building the LLM, or the CLI's "
        "--threads %d",
        load, n, threads, fewer, fewer,
    )  # fmt: skip
    return True
