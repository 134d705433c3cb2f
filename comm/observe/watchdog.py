"""The collective watchdog: deadlines on every comm op, dumps of every rank, reports that arrive.

One daemon thread per process, started by `soapstone.comm.init()` (which every rank calls), does
four things, waking every `poll_s` seconds (and at once on a signal):

- Deadlines. The flight recorder (flight_recorder.py) marks the entry the main thread is blocked
  in (a blocking collective or p2p call, or a Work's wait()); with recording off
  (SOAPSTONE_FLIGHT_RECORDER=0) this thread finds that call on the main thread's stack instead
  (status.sample_blocked: nothing on the hot path, the deadline good to one poll). When one has been
  blocked longer
  than SOAPSTONE_COLLECTIVE_TIMEOUT seconds (default 600; 0 disables; `run --collective-timeout`)
  this rank reports: it asks every rank for its status over a side channel, prints one report
  (the op, the communicator's mesh axis and world ranks, the sequence number, the ranks that did
  not arrive, what they are doing and where their stacks are), and ends the job with MPI Abort.
  NCCL ops are enqueued, not blocking: their CUDA events are polled here, the same deadline.
- The side channel: a duplicate of MPI.COMM_WORLD, used only by this thread (and the failure
  handler), tags NOTICE and REPLY. Blocking MPI calls in the main thread and probes here need
  MPI_THREAD_MULTIPLE, which mpi4py requests by default (start() checks it; with less, no
  watchdog runs and failures abort as before, without the other ranks' dumps). A rank that gets
  a notice dumps its flight recorder and answers with its status. When several ranks time out
  together, the lowest-numbered one reports; the others answer it and wait for its Abort.
- Dumps: on a timeout, an uncaught exception (comm/launch/failure.py) or SIGUSR1 (to any rank, or to
  mpiexec, which forwards it), a rank writes its flight recorders and Python stacks (faulthandler,
  all threads) to `SOAPSTONE_TRACE_DIR/rank<R>.json` (or `run --debug-dir`) and a short form to
  stderr. `soapstone debug hang DIR` reads them (diagnose.py).
- Bad input met mid-run (a UserError reaching the failure handler, comm/launch/failure.py):
  the rank that met it tells rank 0 over the side channel; rank 0 prints its one line, once,
  and ends the job with exit 2 (EXIT_BAD_INPUT), no dumps.
- Signals: with `exit_on_signals()` (the run command), SIGTERM/SIGINT end every rank promptly,
  rank 0 printing one line, even when a rank is blocked inside MPI where Python signal handlers
  cannot run (signal.set_wakeup_fd wakes this thread). The ranks meet in a barrier on the side
  channel (bounded) and then exit together, so the job exits 128+signal (Hydra SIGKILLs the
  ranks still alive once one has exited). A signal that comes before exit_on_signals ends a
  rank by its default action; the rank's supervisor, which forwarded it, reports that as the
  stop it is (comm/launch/supervisor.py), not as a death.

Output that arrives: before Abort, a reporting rank flushes stdout/stderr and waits (bounded)
until the launcher has read its pipes (FIONREAD on the pipe reaches 0), so the report is not lost
when mpiexec tears the job down. The other ranks answer a notice only after the same drain.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import math
import os
import select
import signal
import stat
import struct
import sys
import termios
import threading
import time
import traceback
from pathlib import Path

from soapstone.comm.errors import UserError
from soapstone.comm.observe.diagnose import doing, report_end, stack_tail, timeout_report
from soapstone.comm.observe.flight_recorder import (
    T_START,
    T_WAIT,
    describe,
    entry_text,
    live_recorders,
)
from soapstone.comm.observe.peers import GONE_AFTER_S, Peers, here
from soapstone.comm.observe.status import dump_lines, sample_blocked, say, status, write_dump

DEFAULT_TIMEOUT_S = 600.0
TAG_NOTICE, TAG_REPLY = 30571, 30572
EXIT_CODE = 1  # the job's exit code after a watchdog or failure Abort
EXIT_BAD_INPUT = 2  # ... and after bad input met mid-run (report_bad_input)
DRAIN_S = 5.0  # at most this long for the launcher to read our stdout/stderr before Abort
GATHER_S = 5.0  # at most this long for the other ranks' statuses
MEET_S = 2.0  # at most this long for every rank to reach its exit on SIGTERM/SIGINT
MEET_MARGIN_S = 0.05  # ... then they exit together, this long after the last one got there


class WatchdogError(UserError):
    """A bad watchdog setting (timeout, trace directory)."""


def check_timeout(value, source: str = "SOAPSTONE_COLLECTIVE_TIMEOUT") -> float:
    """A collective timeout in seconds: a finite number >= 0 (0 disables), else WatchdogError."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not (v >= 0 and math.isfinite(v)):
        raise WatchdogError(
            f"{source}={value!r} must be a number of seconds >= 0 (0 disables the collective "
            f"watchdog; default {DEFAULT_TIMEOUT_S:g})")
    return v


def timeout_from_env() -> float:
    """SOAPSTONE_COLLECTIVE_TIMEOUT (seconds; default 600; 0 disables)."""
    text = os.environ.get("SOAPSTONE_COLLECTIVE_TIMEOUT", "").strip()
    return DEFAULT_TIMEOUT_S if not text else check_timeout(text)


def check_trace_dir(value, source: str = "SOAPSTONE_TRACE_DIR") -> str:
    """A directory for dumps: created if missing; WatchdogError if it cannot be."""
    path = Path(value)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WatchdogError(f"{source}={str(value)!r}: cannot create the directory ({e.strerror});"
                            " pick a writable path") from None
    if not os.access(path, os.W_OK):
        raise WatchdogError(f"{source}={str(value)!r} is not writable; pick a writable path")
    return str(path)


def trace_dir_from_env() -> str | None:
    """SOAPSTONE_TRACE_DIR, or None (dumps go to stderr only)."""
    text = os.environ.get("SOAPSTONE_TRACE_DIR", "").strip()
    return check_trace_dir(text) if text else None


_dog: Watchdog | None = None


def get() -> Watchdog | None:
    """The running watchdog of this process (None before init() or without MPI threads)."""
    return _dog


def start(world_mpi) -> Watchdog | None:
    """Start this process's watchdog over the ranks of `world_mpi` (MPI.COMM_WORLD); collective
    (every rank calls it, from init()). None when MPI is not thread-multiple."""
    global _dog
    from mpi4py import MPI

    from soapstone.comm.observe.flight_recorder import capacity_from_env

    timeout, trace_dir = timeout_from_env(), trace_dir_from_env()  # bad values: before any MPI
    if _dog is not None:
        return _dog
    capacity_from_env()
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return None
    _dog = Watchdog(world_mpi.Dup(), timeout, trace_dir)
    return _dog


def configure(timeout: float | None = None, trace_dir: str | None = None) -> None:
    """Change the running watchdog's timeout (seconds; 0 disables) or dump directory (the run
    command's --collective-timeout and --debug-dir); a no-op without a watchdog."""
    if timeout is not None:
        timeout = check_timeout(timeout, "--collective-timeout")
    if trace_dir is not None:
        trace_dir = check_trace_dir(trace_dir, "--debug-dir")
    if _dog is not None:
        if timeout is not None:
            _dog.timeout = timeout
        if trace_dir is not None:
            _dog.trace_dir = trace_dir


def drain_stdio(deadline_s: float = DRAIN_S) -> None:
    """Flush stdout/stderr and wait (at most `deadline_s`) until whoever reads them as pipes
    (mpiexec's proxy) has read everything: what is still in a pipe when the job is killed is
    lost."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    end = time.monotonic() + deadline_s
    for fd in (1, 2):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            while time.monotonic() < end:
                unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
                if unread <= 0:
                    break
                time.sleep(0.005)
        except OSError:
            continue


def quiet_stderr() -> None:
    """Point stderr at /dev/null (after drain_stdio): what MPI prints as it aborts for bad input
    would add lines to the one the user needs."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


# -- the watchdog ------------------------------------------------------------------------------
class Watchdog:
    """The per-process watchdog thread over the side channel `side` (see the module doc)."""

    def __init__(self, side, timeout: float, trace_dir: str | None):
        from mpi4py import MPI

        self._MPI = MPI
        self.side = side
        self.rank, self.size = side.Get_rank(), side.Get_size()
        self.timeout = timeout
        self.trace_dir = trace_dir
        self.reporter: int | None = None  # the rank ending the job (this one or another)
        self.ending = False  # a timeout or failure is being reported: no new reports
        self._yielded = False  # a lower rank reports the same timeout: stop gathering
        self._dumped = False
        self._notified_at = 0.0
        self._summary_printed = False
        self._line_lock = threading.Lock()  # the main thread and this one may both print it
        self._sends: list = []
        self._stop = False
        self._signal_exit: str | None = None  # exit_on_signals(): what to call the program
        self._deferred = False  # defer_signals(): the first SIGTERM/SIGINT only sets stop_signal
        self.stop_signal = 0
        self.peers = Peers(tuple(side.allgather(here())))  # every rank's (host, pid)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._install_signals()
        self._thread = threading.Thread(target=self._loop, name="soapstone-watchdog",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # before mpi4py's MPI_Finalize (atexit runs LIFO)

    @property
    def poll_s(self) -> float:
        """How often the thread wakes: a tenth of the timeout, between 0.05 and 1 s."""
        return 1.0 if not self.timeout else min(1.0, max(0.05, self.timeout / 10))

    def stop(self) -> None:
        """End the thread (at exit, before MPI is finalized)."""
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # -- signals -------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGUSR1, _ignore)  # the C handler still writes to the wakeup fd

    def exit_on_signals(self, program: str) -> None:
        """SIGTERM/SIGINT end this rank promptly (exit 128+signal, rank 0 printing one line
        `{program}: stopped by SIGTERM ...`), also while it is blocked in MPI. Main thread."""
        self._signal_exit = program
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _ignore)  # handled by the watchdog thread, via the wakeup fd

    def defer_signals(self) -> None:
        """After exit_on_signals: the first SIGTERM/SIGINT only sets `stop_signal`, so the
        program can stop at a point of its choosing (run saves a checkpoint); a second one
        exits at once, as before."""
        self._deferred = True

    @property
    def deferring(self) -> bool:
        """Whether defer_signals() is in force (the first SIGTERM/SIGINT sets stop_signal)."""
        return self._deferred

    def _on_signals(self, data: bytes) -> None:
        for signum in data:
            if signum == signal.SIGUSR1:
                st = status("SIGUSR1")
                path = write_dump(st, self.trace_dir)
                say(self.rank, dump_lines(st) + ([f"  dump: {path}"] if path else []))
            elif signum in (signal.SIGTERM, signal.SIGINT) and self._signal_exit:
                name = signal.Signals(signum).name
                if self._deferred and not self.stop_signal:
                    self.stop_signal = signum
                    if self.rank == 0:
                        print(f"{self._signal_exit}: {name}: stopping after this step (a "
                              "second signal stops at once)", file=sys.stderr, flush=True)
                    continue
                if self.rank == 0:
                    print(f"{self._signal_exit}: stopped by {name}; every rank exits",
                          file=sys.stderr, flush=True)
                drain_stdio(1.0)
                self._meet(MEET_S)
                os._exit(128 + signum)

    def _meet(self, wait_s: float) -> bool:
        """Wait until every rank has called this (bounded by `wait_s`: False when one did not),
        then until one wall-clock instant they agreed on: Hydra SIGKILLs a job's live ranks the
        moment one of them exits without MPI_Finalize, and a rank killed so makes the job's
        exit code 9, not 128+signal; ranks that exit at one instant all reach their exit."""
        sys.setswitchinterval(1e-4)  # the main thread must not keep this one waiting for ms
        if self.size == 1:
            return True
        import array

        mine = array.array("d", [time.time() + MEET_MARGIN_S])
        when = array.array("d", [0.0])
        req = self.side.Iallreduce(mine, when, op=self._MPI.MAX)
        end = time.monotonic() + wait_s
        while not req.Test():  # spin, no sleep: any delay here is a rank left behind
            if time.monotonic() > end:
                return False
        left = when[0] - time.time()
        if left > 0.002:
            time.sleep(left - 0.002)  # the rest spun: a sleep may overshoot by a timeslice
        while time.time() < when[0]:
            pass
        return True

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        broken = False
        while not self._stop:
            try:
                ready = select.select([self._wake_r], [], [], self.poll_s)[0]
                if self._stop:
                    break
                if ready:
                    with contextlib.suppress(BlockingIOError):
                        self._on_signals(os.read(self._wake_r, 64))
                self._serve()
                if self.reporter != self.rank:
                    self._check(time.monotonic())
                self._sends = [r for r in self._sends if not r.Test()]
            except Exception:  # never let the watchdog itself take the job down
                if not broken:
                    broken = True
                    say(self.rank, ["soapstone watchdog: internal error (watching stops):"]
                         + traceback.format_exc().rstrip().split("\n"))
                time.sleep(self.poll_s)

    def _check(self, now: float) -> None:
        """Complete NCCL entries whose event fired; expire an op past the deadline."""
        sample_blocked(now)
        for rec in live_recorders():
            if rec.pending:
                self._poll_events(rec)
            e = rec.blocked()
            if e is None:
                continue
            waited = now - (e[T_WAIT] or e[T_START])
            if self.timeout > 0 and waited > self.timeout:
                self._expire(rec, e, waited)
                return
            gone = self.peers.gone(r for r in rec.world_ranks if r != self.rank) \
                if waited > GONE_AFTER_S else []
            if gone:  # they can never arrive: say who, end the job now (peers.py)
                self._gone(rec, e, gone)
                return

    @staticmethod
    def _poll_events(rec) -> None:
        """NCCL: mark DONE the enqueued entries whose CUDA event has fired (oldest first; the
        stream runs them in order). Not exercised here: no GPU on the machines tested."""
        pending = rec.pending
        done = 0
        while done < len(pending) and pending[done][1].query():
            rec.complete(pending[done][0])
            done += 1
        del pending[:done]

    # -- the side channel ----------------------------------------------------------------------
    def _notify(self, kind: str, what: str) -> None:
        msg = {"kind": kind, "rank": self.rank, "what": what}
        for r in range(self.size):
            if r != self.rank:
                self._sends.append(self.side.isend(msg, r, TAG_NOTICE))

    def _serve(self) -> None:
        """Answer every notice that has arrived: dump, drain, reply with this rank's status."""
        MPI = self._MPI
        st = MPI.Status()
        while self.side.iprobe(MPI.ANY_SOURCE, TAG_NOTICE, st):
            msg = self.side.recv(source=st.Get_source(), tag=TAG_NOTICE)
            self._on_notice(msg)

    def _on_notice(self, msg: dict) -> None:
        if msg["kind"] == "bad input":  # rank 0: another rank met it; no dumps, one line
            self.ending = True
            if self._claim_line():
                print(msg["what"], file=sys.stderr, flush=True)
                self._end_bad_input()
            return
        src = msg["rank"]
        if self.reporter is None:
            self.reporter = src
        elif self.reporter == self.rank and src < self.rank and msg["kind"] == "timeout":
            self.reporter, self._yielded = src, True  # a lower rank reports this hang
        self.ending = True
        self._notified_at = time.monotonic()
        lines = []
        if msg["kind"] == "failure" and self.rank == 0 and not self._summary_printed:
            self._summary_printed = True
            lines.append(f"soapstone: rank {src} failed: {msg['what']}; aborting the job")
        reason = f"{msg['kind']} on rank {src}"
        st = status(reason, entries=not self._dumped)
        if not self._dumped:  # one line here; the reporter prints what matters, the file all
            self._dumped = True
            path = write_dump(st, self.trace_dir)
            lines.append(f"flight recorder ({reason}): {doing(st)}"
                         + (f"; dump: {path}" if path else ""))
        say(self.rank, lines)
        drain_stdio(2.0)
        for snap in st["comms"]:
            snap.pop("entries", None)
        self._sends.append(self.side.isend(st, src, TAG_REPLY))

    def _gather(self, wait_s: float, serve: bool) -> dict[int, dict]:
        """The statuses that other ranks send back within `wait_s` (all of them, usually)."""
        MPI = self._MPI
        replies: dict[int, dict] = {}
        st = MPI.Status()
        end = time.monotonic() + wait_s
        while len(replies) < self.size - 1 and time.monotonic() < end:
            while self.side.iprobe(MPI.ANY_SOURCE, TAG_REPLY, st):
                msg = self.side.recv(source=st.Get_source(), tag=TAG_REPLY)
                replies[msg["rank"]] = msg
            if serve:
                self._serve()
                if self._yielded:
                    break
            time.sleep(0.01)
        return replies

    # -- ending the job ------------------------------------------------------------------------
    def _expire(self, rec, e: list, waited: float) -> None:
        """This rank's op `e` on `rec`'s communicator is past the deadline: report, Abort."""
        now = time.monotonic()
        if self.reporter is not None and self.reporter != self.rank:
            # another rank is reporting; report too only if it has not ended the job by now
            if now - self._notified_at < GATHER_S + 2 * DRAIN_S + self.timeout:
                return
        self.reporter, self.ending = self.rank, True
        entry = {"key": rec.key, **describe(e, now)}
        what = entry_text(entry, rec.key)
        self._notify("timeout", what)
        replies = self._gather(GATHER_S, serve=True)
        if self._yielded:
            return  # a lower rank reports; its Abort ends this process too
        mine = status(f"timeout on rank {self.rank}")
        self._dumped = True
        path = write_dump(mine, self.trace_dir)
        statuses = {self.rank: mine, **replies}
        lines = timeout_report(self.rank, self.timeout, waited, rec.key, entry, statuses,
                               self.trace_dir, self.peers)
        mine_lines = [f"  rank {self.rank} (this rank): newest ops"] + dump_lines(mine)[1:]
        lines += mine_lines + report_end(self.trace_dir)
        say(self.rank, lines)
        if path:
            with contextlib.suppress(OSError):
                Path(self.trace_dir, "report.txt").write_text("\n".join(lines) + "\n")
        self.abort()

    def _gone(self, rec, e: list, gone: list[int]) -> None:
        """Members of the communicator this rank waits in have no process any more: report
        who and where, dump, Abort."""
        self.reporter, self.ending = self.rank, True
        entry = {"key": rec.key, **describe(e, time.monotonic())}
        mine = status(f"rank {', '.join(map(str, gone))} gone")
        self._dumped = True
        path = write_dump(mine, self.trace_dir)
        lines = [f"soapstone watchdog: {', '.join(self.peers.name(r) for r in gone)} is gone "
                 f"(its process ended) while rank {self.rank} waits for it in "
                 + entry_text(entry, rec.key).split(":")[0]]
        lines += dump_lines(mine)[1:] + ([f"  dump: {path}"] if path else []) + \
            ["  aborting the job"]
        say(self.rank, lines)
        self.abort()

    def report_failure(self, summary: str) -> None:
        """The failure handler's part (main thread, after it printed the traceback): every
        other rank dumps and answers (bounded), rank 0 prints the one-line summary, then the
        job is aborted."""
        self.ending = True
        if self.reporter is None:
            self.reporter = self.rank
        lines = []
        if self.rank == 0 and not self._summary_printed:
            self._summary_printed = True
            lines.append(f"soapstone: rank 0 failed: {summary}; aborting the job")
        mine = status(f"failure on rank {self.rank}: {summary}")
        self._dumped = True
        mine["failure"] = summary
        path = write_dump(mine, self.trace_dir)
        lines += dump_lines(mine)[:-1 - len(stack_tail(mine, 4))]  # the traceback is above
        say(self.rank, lines + ([f"  dump: {path}"] if path else []))
        self._notify("failure", summary)
        self._gather(GATHER_S, serve=False)
        self.abort()

    def report_bad_input(self, line: str) -> None:
        """The failure handler's part for bad input met mid-run (failure.end_on_bad_input):
        the job ends with exit 2 and `line` printed once, by rank 0. Another rank sends it to
        rank 0 and waits, bounded, for rank 0's Abort; if none comes it prints the line
        itself. Never returns."""
        self.ending, self.reporter = True, self.rank  # no deadline reports from now on
        if self.rank != 0:
            sent = self.side.isend({"kind": "bad input", "rank": self.rank, "what": line}, 0,
                                   TAG_NOTICE)
            self._sends.append(sent)
            # rank 0's watchdog answers within a poll and its drain; its Abort ends us too
            time.sleep(self.poll_s + GATHER_S + DRAIN_S)
            sent.Test()  # held (and so its message) until here, whatever the loop drops
            say_it = True  # rank 0 did not end the job: the line must come from here,
            line = f"[rank {self.rank}] {line}"  # and say whose it is
        else:
            say_it = self._claim_line()
            if not say_it:  # this rank's watchdog printed another rank's line and aborts
                time.sleep(DRAIN_S + 1.0)
        if say_it:
            print(line, file=sys.stderr, flush=True)
        self._end_bad_input()

    def _claim_line(self) -> bool:
        """True for the first caller only: the one line of bad input is printed once."""
        with self._line_lock:
            first = not self._summary_printed
            self._summary_printed = True
        return first

    def _end_bad_input(self) -> None:
        drain_stdio()
        quiet_stderr()
        self._MPI.COMM_WORLD.Abort(EXIT_BAD_INPUT)

    def abort(self) -> None:
        """Let the launcher read everything printed, then MPI Abort the whole job."""
        drain_stdio()
        time.sleep(0.05)
        self._MPI.COMM_WORLD.Abort(EXIT_CODE)


def _ignore(signum, frame) -> None:
    """A Python-level handler that does nothing: the watchdog thread acts on the signal."""
