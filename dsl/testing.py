"""Test helpers for pytest users: golden runs as assertions.

    # record once, on one rank (or `soapstone golden record spec.par -o run.npz`)
    from soapstone.dsl.testing import record_golden, assert_matches_golden
    record_golden("model.par", "tests/golden/model.npz", steps=5)

    # in a test that runs under `mpiexec -n N` (e.g. a case of tests/support/mpirun.py):
    assert_matches_golden("model.par", "tp2", "tests/golden/model.npz")

`assert_matches_golden` trains the layout on this process's MPI world exactly as the record
says (steps, seed, optimizer, lr, precision, dims, data) and raises AssertionError naming the
first step and tensor that left the record (tolerances: shard/train/golden.py).
"""

from __future__ import annotations

from soapstone.dsl.app.golden_run import check_run, record_run

__all__ = ["assert_matches_golden", "record_golden"]


def record_golden(spec: str, output: str, *, model: str | None = None, steps: int = 5,
                  seed: int = 0, optimizer: str = "sgd", lr: float | None = None,
                  dims: dict | None = None, plugins: tuple[str, ...] = (),
                  data: str | None = None, parallel: str | None = None):
    """Record a single-rank run of `spec`'s model to `output` (.npz); returns the Record.
    `parallel`: a one-rank layout to run instead (e.g. gradient accumulation)."""
    return record_run(spec, output, model=model, dims=dims, plugins=plugins, steps=steps,
                      seed=seed, optimizer=optimizer, lr=lr, data=data, parallel=parallel)


def assert_matches_golden(spec: str, parallel: str | None, record_file: str, *,
                          plugins: tuple[str, ...] = (), loss_rtol: float | None = None,
                          param_rtol: float | None = None) -> None:
    """Assert that layout `parallel` of `spec` reproduces the recorded run (collective: call it
    on every rank of a world of the layout's size)."""
    from soapstone.shard.train import golden

    tol = None
    if loss_rtol is not None or param_rtol is not None:
        tol = golden.Tolerance.for_record(golden.load(record_file).header)
        tol.loss_rtol = tol.loss_rtol if loss_rtol is None else loss_rtol
        tol.param_rtol = tol.param_rtol if param_rtol is None else param_rtol
    bad = check_run(spec, parallel, record_file, plugins=plugins, tol=tol)
    if bad is not None:
        raise AssertionError(f"{parallel or 'one rank'} of {spec} leaves {record_file} at {bad}")
