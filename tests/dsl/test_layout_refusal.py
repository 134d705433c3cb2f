"""A file's layouts that cannot take a --dim no longer block the others (dsl/lang/spec.py:
`Spec.refused`). Without --parallel, each layout the sizes break is one `note:` line naming
it and the reason at its place, and check / explain / show / run go on with the rest (and
with the model); exit 2 only when no layout can take them (check) or when --parallel names
a refused one (its full diagnostic). A layout broken at the file's own dims stays an error."""

from __future__ import annotations

from pathlib import Path

from cli_calls import cli

from soapstone import dsl

ROOT = Path(__file__).resolve().parents[2]
GPT2_124M = ["--dim", "vocab=50257", "--dim", "hidden=768", "--dim", "heads=12",
             "--dim", "ffn=3072", "--dim", "max_seq=1024"]
MQA = ["--dim", "kv_heads=1"]  # multi-query: no 2-way split of kv_heads


def _notes(text: str) -> dict[str, str]:
    return {line.split()[2]: line for line in text.splitlines() if line.startswith("note: layout")}


def test_refused_layouts_are_kept_with_their_reasons():
    spec = dsl.load(ROOT / "examples/llama.par", dims={"kv_heads": 1})
    assert set(spec.refused) == {"tp2", "sp2", "sp2async", "cp2sp2", "ptd8", "cp2bsp2"}
    assert set(spec.parallels) == {"single", "dp2", "tp4", "cp2", "pp2"}  # tp4: kv whole
    assert not spec.diagnostics
    lines = spec.refusals()
    assert len(lines) == 6 and all("kv_heads = 1 does not divide over model = 2" in x
                                   for x in lines)


def test_check_explain_show_run_go_on_with_the_layouts_that_can():
    runs = cli(["check", "examples/llama.par", *MQA],
               ["check", "examples/gpt2.par", *GPT2_124M],
               ["explain", "examples/llama.par", *MQA, "--parallel", "cp2"],
               ["explain", "examples/gpt2.par", *GPT2_124M],
               ["show", "examples/llama.par", *MQA],
               ["run", "examples/llama.par", *MQA, "--steps", "1", "--quiet"])
    for r in runs:
        assert r["rc"] == 0, r
        assert "Traceback" not in r["text"]
    llama, gpt2 = _notes(runs[0]["text"]), _notes(runs[1]["text"])
    assert set(llama) == {"tp2", "sp2", "sp2async", "cp2sp2", "ptd8", "cp2bsp2"}
    assert "examples/llama.par:47:20: kv_heads = 1 does not divide over model = 2" in llama["tp2"]
    assert "parallels: single, dp2, tp4, cp2, pp2" in runs[0]["text"]
    assert set(gpt2) == {"tp2", "sp2", "dptp4", "ptd8", "cp2bsp2"}
    assert all("vocab = 50257 does not divide over model = 2" in x for x in gpt2.values())
    assert "parallels: single, dp2, cp2, cp2b, pp2" in runs[1]["text"]
    assert not _notes(runs[2]["text"])  # --parallel names a layout that can: no notes
    for r in runs[3:]:  # without --parallel: the notes, then the model's own output
        assert len(_notes(r["text"])) in (5, 6), r["text"]


def test_exit_2_when_the_named_layout_or_every_layout_is_refused(tmp_path):
    only_tp = tmp_path / "only_tp.par"
    text = (ROOT / "examples/llama.par").read_text()
    cut = [text.index(f"\nparallel {name} for") for name in ("single", "tp2", "tp4")]
    only_tp.write_text(text[:cut[0]] + text[cut[1]:cut[2]])
    runs = cli(["check", "examples/llama.par", *MQA, "--parallel", "tp2"],
               ["run", "examples/llama.par", *MQA, "--parallel", "sp2", "--steps", "1"],
               ["check", str(only_tp), *MQA],
               ["check", "examples/llama.par", "--dim", "heads=3"])  # the model itself
    for r in runs:
        assert r["rc"] == 2, r
        assert "Traceback" not in r["text"]
    assert "examples/llama.par:47:20: error: kv_heads = 1 does not divide over model = 2" \
        in runs[0]["text"]
    assert "hint:" in runs[0]["text"]  # the full diagnostic when named
    assert "examples/llama.par:55:20: error" in runs[1]["text"]
    assert "no layout can take these --dim sizes (tp2" in runs[2]["text"]
    assert "hidden = 32 does not divide evenly over heads = 3" in runs[3]["text"]


def test_a_layout_broken_at_the_files_own_dims_stays_an_error(tmp_path):
    bad = tmp_path / "bad.par"
    bad.write_text((ROOT / "examples/llama.par").read_text().replace(
        "parallel cp2 for llama on mesh(cp = 2)", "parallel cp2 for llama on mesh(cp = 3)"))
    r = cli(["check", str(bad), *MQA])[0]
    assert r["rc"] == 2, r
    assert "seq = 16 does not divide over cp = 3" in r["text"], r["text"]
