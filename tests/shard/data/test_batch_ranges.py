"""A batch's ids and targets are checked against the ranges the model indexes with them
(shard/data/batch_check.py, called by Executor.microbatches): which inputs, with which limits,
on every layout, and under mpiexec (tests/shard/data/batch_range_cases.py) the refusal of a
bad batch on one rank and on the layouts that split the vocab."""

from __future__ import annotations

import pytest
import torch
from mpirun import case_params

from soapstone import dsl
from soapstone.dsl.compile.stages import lower_graph
from soapstone.shard.data.batch_check import check_ranges, index_ranges
from soapstone.shard.data.errors import DataError

CASES = "tests/shard/data/batch_range_cases.py"


@pytest.mark.parametrize("case,n", case_params(CASES))
def test_case(comm_runs, case, n):
    comm_runs(n, CASES).check(case)


@pytest.mark.parametrize("layout", ["single", "tp2", "sp2", "gpt8"])
def test_ranges_are_found_through_redistributions_and_stages(layout):
    """sp2 reads `tokens@model:R`, gpt8 has the embedding and the loss on different stages:
    both inputs are found either way, with the vocab as their limit."""
    spec = dsl.load("examples/gpt.par")
    par = spec.parallel(layout)
    graph = lower_graph(spec.model(par.model), par)
    ranges = index_ranges([s.program for s in graph.stages])
    assert {n: r.limit for n, r in ranges.items()} == {"tokens": 64, "targets": 64}


def test_the_ends_of_the_range_pass_and_one_past_them_fails():
    spec = dsl.load("examples/gpt.par")
    ranges = index_ranges([lower_graph(spec.model(), None).program])
    ok = {"tokens": torch.tensor([[0, 63]]), "targets": torch.tensor([[63, 0]])}
    check_ranges(ranges, ok)
    for name, bad, where in (("tokens", 64, [0, 1]), ("targets", -1, [0, 0])):
        batch = dict(ok)
        batch[name] = ok[name].clone()
        batch[name][tuple(where)] = bad
        with pytest.raises(DataError, match=rf"input {name}: value {bad} at \{where} "):
            check_ranges(ranges, batch)
