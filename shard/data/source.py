"""A run's data source: a memory-mapped token file with --data, the synthetic task otherwise
(its own module, above both, so neither imports the other's)."""

from __future__ import annotations

from soapstone.shard.data.errors import DataError
from soapstone.shard.data.tasks import SyntheticTask
from soapstone.shard.data.token_memmap import TokenMemmap, check_dtype_applies
from soapstone.shard.plan.program import Program


def make_task(program: Program, seed: int = 0, data: str | None = None,
              val_data: str | None = None, data_dtype: str | None = None) -> SyntheticTask:
    """The data source of a run: a memory-mapped token file with --data (held-out batches
    from --val-data or its tail), the synthetic task otherwise."""
    if not data:
        if val_data:
            raise DataError(f"--val-data {val_data}: give --data too (the synthetic task "
                            "has its own held-out batches)")
        check_dtype_applies(data_dtype, [])
        return SyntheticTask(program, seed)
    return TokenMemmap(program, data, seed, val_path=val_data, dtype=data_dtype)
