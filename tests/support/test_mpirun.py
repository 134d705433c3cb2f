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


def test_one_launch_runs_several_files_and_keeps_them_apart(cases_file, tmp_path):
    """Several case files in one launch (conftest launches every planned file of a world size
    together): each file's outcomes on their own, a file that fails to import fails its own
    cases and no other file's."""
    broken = tmp_path / "broken_cases.py"
    broken.write_text("from mpirun import ranks\nimport no_such_module\n\n"
                      "@ranks(1)\ndef case_one():\n    pass\n")
    res = run_cases(1, [cases_file, broken], timeout=60)
    assert res.launch.ok, res.launch.report()
    mine = res.of(cases_file)
    assert sorted(mine.cases) == ["case_one", "case_one_and_two"]
    mine.check("case_one")
    other = res.of(broken)
    assert other.cases["case_one"][0][0] == "FAIL"
    assert "no_such_module" in other.cases["case_one"][0][1]
    assert res.of(tmp_path / "never_ran.py") is None
