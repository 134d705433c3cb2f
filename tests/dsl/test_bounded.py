"""Bounded time and memory for any input: `check`, `show`, `explain`, `plan` and `run`'s fit
check, given absurd sizes (1e20 mesh axes, a 1e12 batch, 1e8 microbatches, a prime world of
~1e9), end with exit 0 or a located error (exit 2), never a traceback. Each runs as a real
subprocess under RLIMIT_AS (2 GiB) and a time limit far above what it needs (no timing is
asserted: a command that enumerates runs into the limit and fails). The arithmetic behind
it (divisors by factorisation, the schedules' closed forms) is checked against the walks it
replaces."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from soapstone.shard.plan import schedules
from soapstone.shard.plan.analysis import in_flight
from soapstone.shard.plan.sizes import MAX_DIM, divisors, factorise, is_prime

ROOT = Path(__file__).resolve().parents[2]
LIMIT_AS = 2 << 30
LIMIT_S = 60
HUGE = "100000000000000000000"  # 1e20
MODEL = (ROOT / "examples/gpt.par").read_text().split("parallel single")[0]


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))


def soapstone(*args: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The command under RLIMIT_AS and a time limit; fails the test on a timeout."""
    try:
        return subprocess.run([*launcher, sys.executable, "-m", "soapstone.dsl.cli", *args],
                              cwd=ROOT, text=True, capture_output=True, timeout=LIMIT_S,
                              preexec_fn=_limits, start_new_session=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"soapstone {' '.join(args)} ran past {LIMIT_S} s")


def bounded(r: subprocess.CompletedProcess, codes=(0, 2)) -> str:
    out = r.stdout + r.stderr
    assert r.returncode in codes, (r.args, r.returncode, out[-3000:])
    assert "Traceback" not in out and "MemoryError" not in out, out[-3000:]
    return out


def layout(mesh: str, body: str, model: str = MODEL) -> str:
    return model + f"parallel p for gpt on mesh({mesh}) {{\n{body}\n}}\n"


SPECS = {
    "pipe_axis": layout(f"pipe = {HUGE}, data = 2", "  sample batch -> data\n"
                        "  operator layer[0..1] -> pipe 0, layer[2..3] -> pipe 1"),
    "data_axis": layout(f"data = {HUGE}", "  sample batch -> data"),
    "world_2e30": layout("data = 1073741824", "  sample batch -> data",
                         MODEL.replace("batch = 8", "batch = 1073741824")),
    "dim": MODEL.replace("hidden = 32", f"hidden = {HUGE}") + layout("data = 1", ""),
    "repeat": MODEL.replace("repeat 4", "repeat 1000000000000") + layout("data = 1", ""),
    "microbatches": layout("pipe = 2", "  operator layer[0..1] -> pipe 0, layer[2..3] -> pipe 1\n"
                           "  schedule 1f1b, microbatches = 100000000",
                           MODEL.replace("batch = 8", "batch = 100000000")),
    "accumulation": layout("data = 1", "  schedule 1f1b, microbatches = 100000000",
                           MODEL.replace("batch = 8", "batch = 100000000")),
}


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("absurd")
    for name, text in SPECS.items():
        (d / f"{name}.par").write_text(text)
    return {name: str(d / f"{name}.par") for name in SPECS}


@pytest.mark.parametrize("verify", [False, True])
def test_check_every_absurd_spec(specs, verify):
    out = bounded(soapstone("check", *specs.values(), *(["--verify"] if verify else [])), (2,))
    assert "at most 2147483647" in out  # the 1e20 axes: MPI ranks are 32-bit ints
    assert "at most 9223372036854775807" in out  # a 1e20 dim: torch sizes are int64
    assert "at most 1024 instances" in out  # the repeat
    if verify:  # 1e8 microbatches and 2**30 ranks: refused by the proof, located
        assert "the proof before launch" in out, out


@pytest.mark.parametrize("command", ["show", "explain"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_show_and_explain_any_spec(specs, command, name):
    out = bounded(soapstone(command, specs[name], "--parallel", "p"))
    if name in ("microbatches", "world_2e30") and command == "explain":
        assert "bubble" in out or "checkpoint" in out, out


@pytest.mark.parametrize("args", [
    ["explain", "examples/gpt.par", "--parallel", "gpt8", "--dim", "batch=1000000000000"],
    ["show", "examples/gpt.par", "--parallel", "gpt8", "--dim", "batch=1000000000000"],
    ["check", "examples/gpt.par", "--verify", "--dim", "batch=1000000000000"],
    ["explain", "examples/gpt.par", "--dim", f"batch={HUGE}"],
    ["plan", "examples/gpt.par", "--world", "1000000007", "--profile", "h100-80gb"],
    ["plan", "examples/gpt.par", "--world", "2147483647", "--profile", "h100-80gb"],
    ["plan", "examples/gpt.par", "--world", HUGE, "--profile", "h100-80gb"],
    ["plan", "examples/gpt.par", "--world", "2", "--profile", "cpu-2core", "--dim",
     "batch=10000000"],
    ["plan", "examples/gpt.par", "--world", "8", "--profile", "h100-80gb", "--global-batch",
     "1000000000000"],
    ["run", "examples/gpt.par", "--dim", "batch=100000000", "--steps", "1"],  # the fit check
])
def test_any_flag_value(args):
    out = bounded(soapstone(*args))
    if args[0] == "run":
        assert "does not fit" in out and "hint:" in out, out


def test_fit_check_under_mpiexec_is_bounded():
    """The issue's case: 2 ranks of dp2 with a 1e8 batch (the hint searches layouts)."""
    from mpirun import mpiexec

    out = bounded(soapstone("run", "examples/gpt.par", "--parallel", "dp2", "--dim",
                            "batch=100000000", "--steps", "1", launcher=(mpiexec(), "-n", "2")),
                  (2,))
    assert "does not fit" in out, out


# -- the arithmetic ----------------------------------------------------------------------------

def test_divisors_by_factorisation():
    for n in range(1, 2000):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert divisors(1000000007) == [1, 1000000007] and is_prime(2**61 - 1)
    assert factorise(2147483647 * 2147483629) == {2147483629: 1, 2147483647: 1}
    assert factorise(MAX_DIM) == {7: 2, 73: 1, 127: 1, 337: 1, 92737: 1, 649657: 1}
    assert len(divisors(963761198400)) == 6720


@pytest.mark.parametrize("kind", schedules.KINDS)
def test_in_flight_without_a_long_walk_is_the_walk(kind):
    """What explain uses for any M (a schedule's closed form, or a walk of its `walked`
    microbatches) is what walking the schedule of M gives: snapshots and peaks."""
    spec = schedules.get(kind)
    for p in range(1, 7):
        for v in (2, 3) if spec.chunked else (1,):
            least = spec.least(p) if spec.least is not None else 1  # dualpipev: 2P
            for m in range(p, 9 * p + 1, p) if spec.whole_groups else range(least, 25):
                for r in range(p):
                    assert in_flight.live_in_flight(kind, p, m, v, r) == \
                        in_flight.walk_in_flight(kind, p, m, v, r), (p, v, m, r)


def test_huge_microbatch_counts_walk_short_schedules():
    """No schedule of a million microbatches is built: the walks are of at most 4P."""
    assert schedules.equivalent_microbatches("interleaved", 4, 10**8) == 16
    assert schedules.theory_bubble("1f1b", 2, 10**12) == pytest.approx(1e-12)
