"""`soapstone plan --name`: the block it writes must be one `check` accepts, so a name the
grammar does not read (é) or one the spec already uses (dp2) is exit 2 before planning (both
exited 0 and wrote a spec that check refused)."""

from __future__ import annotations

from cli_calls import cli

PLAN = ["plan", "examples/gpt.par", "--world", "2", "--profile", "cpu-2core"]


def test_plan_name_is_checked_against_the_grammar_and_the_spec(tmp_path):
    out = str(tmp_path / "p.par")
    taken, accent, digit, ok, check = cli([*PLAN, "--name", "dp2", "-o", out],
                                          [*PLAN, "--name", "é", "-o", out],
                                          [*PLAN, "--name", "2x"],
                                          [*PLAN, "--name", "mine", "-o", out],
                                          ["check", out])
    for r in (taken, accent, digit):
        assert r["rc"] == 2, r
        assert "Traceback" not in r["text"] and len(r["stderr"].strip().splitlines()) == 1, r
    assert "--name dp2: examples/gpt.par already has a parallel block 'dp2'" in taken["stderr"]
    assert "--name 'é': a block name is a spec's name: ASCII letters" in accent["stderr"]
    assert "--name '2x'" in digit["stderr"]
    assert ok["rc"] == 0 and check["rc"] == 0, (ok, check)
    assert "mine" in check["stdout"], check
