"""The background writer shared by the prompt cache and the checkpoints: order, flush, supersede, counters."""

from __future__ import annotations

import threading

import pytest

from mlxkv_inference.background_writer import BackgroundWriter, FlushReport, Work, WriterStats


def recording(ran: list[str], name: str, outcome: bool | None = True) -> Work:
    """A job that notes it ran, then returns `outcome`."""

    def job() -> bool | None:
        ran.append(name)
        return outcome

    return job


def test_flush_waits_for_every_queued_job_and_jobs_run_in_order() -> None:
    writer = BackgroundWriter("test-writer")
    gate = threading.Event()
    ran: list[str] = []

    def blocked() -> bool:
        gate.wait()
        ran.append("first")
        return True

    writer.submit("first", blocked, nbytes=10)
    for name in ("second", "third"):
        writer.submit(name, recording(ran, name), nbytes=1)
    assert writer.flush(timeout=0) == FlushReport(settled=False, written=0, failed=0)  # the first job cannot finish
    assert writer.stats() == WriterStats(written=0, failed=0, superseded=0, pending=3, pending_bytes=12)
    gate.set()
    assert writer.flush() == FlushReport(settled=True, written=3, failed=0)
    assert ran == ["first", "second", "third"]
    assert writer.stats() == WriterStats(written=3, failed=0, superseded=0, pending=0, pending_bytes=0)
    writer.close()


def test_a_newer_job_supersedes_a_queued_one_and_if_absent_drops_a_duplicate() -> None:
    writer = BackgroundWriter("test-writer")
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def running() -> bool:
        started.set()
        gate.wait()
        ran.append("a1")
        return True

    writer.submit("a", running)
    started.wait()
    assert writer.submit("a", recording(ran, "a-dup"), if_absent=True) is False
    writer.submit("b", recording(ran, "b1"), nbytes=5)
    writer.submit("b", recording(ran, "b2"), nbytes=7)
    writer.submit("a", recording(ran, "a2"))
    assert writer.stats() == WriterStats(written=0, failed=0, superseded=1, pending=3, pending_bytes=7)
    gate.set()
    assert writer.flush() == FlushReport(settled=True, written=3, failed=0)
    assert ran == ["a1", "b2", "a2"]  # b1 was superseded; a2 waited behind the running a1
    writer.close()


def test_flush_waits_for_what_was_submitted_before_it_not_for_an_empty_queue() -> None:
    """A batch of generations checkpointing every few tokens keeps the queue busy: a flush must
    return once the jobs before it are durable, and a job it is owed is not superseded meanwhile
    (else a key rewritten faster than the disk writes moves the flush's goal on forever)."""
    writer = BackgroundWriter("test-writer")
    first_gate, later_gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def gated(name: str, gate: threading.Event) -> Work:
        def job() -> bool:
            gate.wait()
            ran.append(name)
            return True

        return job

    writer.submit("first", gated("first", first_gate))
    writer.submit("k", recording(ran, "k1"))
    reports: list[FlushReport] = []
    flushing = threading.Thread(target=lambda: reports.append(writer.flush(timeout=30)))
    flushing.start()
    while not writer._flushes:  # the flush has taken its target
        threading.Event().wait(0.001)
    writer.submit("k", recording(ran, "k2"))  # k1 is owed to the flush: both run
    writer.submit("later", gated("later", later_gate))  # submitted after the flush: not awaited
    first_gate.set()
    flushing.join(30)
    assert len(reports) == 1 and reports[0].settled and reports[0].written >= 2  # k2 may have run too
    assert ran[:2] == ["first", "k1"]
    later_gate.set()
    writer.close()
    assert ran == ["first", "k1", "k2", "later"]  # the newest state of k still lands last


def test_a_flush_waits_for_the_jobs_a_job_submits_while_it_runs() -> None:
    writer = BackgroundWriter("test-writer")
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def spawning() -> bool:
        started.set()
        gate.wait()
        writer.submit("follow-up", recording(ran, "follow-up"))
        ran.append("parent")
        return True

    writer.submit("parent", spawning)
    started.wait()
    reports: list[FlushReport] = []
    flushing = threading.Thread(target=lambda: reports.append(writer.flush(timeout=30)))
    flushing.start()
    while not writer._flushes:
        threading.Event().wait(0.001)
    gate.set()
    flushing.join(30)
    assert reports == [FlushReport(settled=True, written=2, failed=0)] and ran == ["parent", "follow-up"]
    writer.close()


def test_failed_and_raising_jobs_are_counted_and_reported_once() -> None:
    writer = BackgroundWriter("test-writer")

    def broken() -> bool:
        raise OSError(28, "No space left on device")

    ran: list[str] = []
    writer.submit("ok", recording(ran, "ok"))
    writer.submit("false", recording(ran, "false", False))
    writer.submit("raises", broken)
    writer.submit("removal", recording(ran, "removal", None))
    assert writer.flush() == FlushReport(settled=True, written=1, failed=2)
    assert writer.flush() == FlushReport(settled=True, written=0, failed=0)  # reported by the previous flush
    writer.submit("later", recording(ran, "later"))  # the thread survived the faults
    assert writer.flush() == FlushReport(settled=True, written=1, failed=0)
    assert ran == ["ok", "false", "removal", "later"]
    assert writer.stats() == WriterStats(written=2, failed=2, superseded=0, pending=0, pending_bytes=0)
    writer.close()


def test_counters_are_exact_under_concurrent_submitters() -> None:
    writer = BackgroundWriter("test-writer")
    threads, per_thread = 8, 300
    ran: list[int] = []  # appended on the writer's one thread only

    def submit_all(t: int) -> None:
        for i in range(per_thread):
            n = t * per_thread + i

            def job(n: int = n) -> bool:
                ran.append(n)
                return n % 3 != 0

            # Keys repeat across threads, so some queued jobs are superseded by another thread's.
            writer.submit(i % 50, job, nbytes=n)
            writer.stats()

    workers = [threading.Thread(target=submit_all, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    report = writer.flush()
    stats = writer.stats()
    assert report == FlushReport(True, stats.written, stats.failed)
    assert stats.written == sum(1 for n in ran if n % 3 != 0)
    assert stats.failed == sum(1 for n in ran if n % 3 == 0)
    assert stats.written + stats.failed + stats.superseded == threads * per_thread
    assert (stats.pending, stats.pending_bytes) == (0, 0)
    writer.close()


def test_close_runs_what_is_queued_then_refuses_new_jobs() -> None:
    writer = BackgroundWriter("test-writer")
    ran: list[str] = []
    for name in "abcde":
        writer.submit(name, recording(ran, name))
    assert writer.close(timeout=30) == FlushReport(settled=True, written=5, failed=0)
    assert ran == list("abcde")
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit("late", recording(ran, "late"))
