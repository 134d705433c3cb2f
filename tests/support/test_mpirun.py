"""tests/support/mpirun.py: every distributed case declares the world sizes it runs at, and a launch
of size n runs exactly the cases declared for n."""

from __future__ import annotations

import textwrap

import pytest
from mpirun import case_params, case_sizes, ranks, run_cases

CASES = """
from mpirun import ranks

@ranks(1)
def case_one():
    pass

@ranks(1, 2)
def case_one_and_two():
    pass

@ranks(2)
def case_two():
    raise AssertionError("a case declared for 2 ranks ran on 1")

def helper():
    pass
"""


@pytest.fixture
def cases_file(tmp_path):
    path = tmp_path / "my_cases.py"
    path.write_text(textwrap.dedent(CASES))
    return path


def test_declared_sizes_are_read_from_the_source(cases_file):
    assert case_sizes(cases_file) == {"case_one": (1,), "case_one_and_two": (1, 2),
                                      "case_two": (2,)}
    assert case_params(cases_file) == [("case_one", 1), ("case_one_and_two", 1),
                                       ("case_one_and_two", 2), ("case_two", 2)]
    assert case_params(cases_file, ["case_two"], sizes=[1, 2]) == [("case_two", 2)]


def test_a_case_without_a_declaration_is_an_error(cases_file):
    cases_file.write_text(cases_file.read_text() + "\n\ndef case_forgotten():\n    pass\n")
    with pytest.raises(ValueError, match=r"my_cases.py:\d+: case_forgotten must declare"):
        case_sizes(cases_file)


def test_a_name_that_is_no_case_is_an_error(cases_file):
    with pytest.raises(ValueError, match="no cases"):
        case_params(cases_file, ["case_typo"])


@pytest.mark.parametrize("sizes", [(), (0,), (2.0,)])
def test_ranks_takes_world_sizes(sizes):
    with pytest.raises(ValueError, match="world sizes"):
        ranks(*sizes)


def test_a_launch_runs_the_cases_declared_for_its_size(cases_file):
    res = run_cases(1, cases_file, timeout=60)
    assert res.launch.ok, res.launch.report()
    assert sorted(res.cases) == ["case_one", "case_one_and_two"]
    res.check("case_one")
