"""Front end unit tests: parsing, layer expansions, dims, includes, overrides, custom layers,
the Spec API and the check/show commands."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import soapstone.dsl as dsl
from soapstone.dsl import SpecError, load
from soapstone.dsl.cli import main as cli
from soapstone.dsl.layers import custom
from soapstone.dsl.model import ir

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def model_text(body: str, dims: str = "dim batch = 4, seq = 8, hidden = 16, heads = 4") -> str:
    return f"model m {{\n  {dims}\n{textwrap.indent(textwrap.dedent(body), '  ')}}}\n"


def errors(text: str, **kw) -> list[dsl.Diagnostic]:
    with pytest.raises(SpecError) as e:
        load(text, **kw)
    return e.value.diagnostics


# ---- layer expansions --------------------------------------------------------------------------


def test_attention_expands_to_exact_primitives():
    m = load(model_text("""
        input x : f32[batch, seq, hidden]
        output y = attention(x, heads = heads, causal = true)
    """)).model()
    assert [(p.name, p.type.dims, p.init) for p in m.params] == [
        ("attention0.wq", ("hidden", "heads", "head_dim"), "normal(0.02)"),
        ("attention0.wk", ("hidden", "heads", "head_dim"), "normal(0.02)"),
        ("attention0.wv", ("hidden", "heads", "head_dim"), "normal(0.02)"),
        ("attention0.wo", ("heads", "head_dim", "hidden"), "normal(0.02)"),
        ("attention0.bo", ("hidden",), "zeros"),
    ]
    ops = [(o.kind, o.args, o.out, o.type.dims, o.attrs) for o in m.ops]
    P = "attention0."
    bhsk = ("batch", "heads", "seq", "seq_k")
    assert ops == [
        ("einsum", ("x", P + "wq"), P + "q", ("batch", "seq", "heads", "head_dim"), ()),
        ("einsum", ("x", P + "wk"), P + "k", ("batch", "seq", "heads", "head_dim"), ()),
        ("einsum", ("x", P + "wv"), P + "v", ("batch", "seq", "heads", "head_dim"), ()),
        ("rename", (P + "k",), P + "k2", ("batch", "seq_k", "heads", "head_dim"),
         (("dst", "seq_k"), ("src", "seq"))),
        ("rename", (P + "v",), P + "v2", ("batch", "seq_k", "heads", "head_dim"),
         (("dst", "seq_k"), ("src", "seq"))),
        ("einsum", (P + "q", P + "k2"), P + "scores", bhsk, (("scale", 1 / math.sqrt(4)),)),
        ("causal_mask", (P + "scores",), P + "masked", bhsk,
         (("key", "seq_k"), ("query", "seq"))),
        ("softmax", (P + "masked",), P + "probs", bhsk, (("over", "seq_k"),)),
        ("einsum", (P + "probs", P + "v2"), P + "o", ("batch", "seq", "heads", "head_dim"), ()),
        ("einsum", (P + "o", P + "wo"), P + "y", ("batch", "seq", "hidden"), ()),
        ("add", (P + "y", P + "bo"), "y", ("batch", "seq", "hidden"), ()),
    ]
    assert all(o.layer == "attention" and o.block is None for o in m.ops)
    assert dict(m.dims)["head_dim"] == 4 and dict(m.dims)["seq_k"] == 8
    assert m.dim_alias == (("seq_k", "seq"),)
    assert m.outputs == (ir.Output("y", "y", False),)


def test_attention_not_causal_and_reuses_declared_head_dim():
    m = load(model_text("""
        dim head_dim = hidden / heads
        input x : f32[batch, seq, hidden]
        output y = attention(x, heads = heads, causal = false)
    """)).model()
    assert "causal_mask" not in [o.kind for o in m.ops]
    assert [d for d, _ in m.dims].count("head_dim") == 1
    errs = errors(model_text("""
        dim head_dim = 3
        input x : f32[batch, seq, hidden]
        output y = attention(x, heads = heads)
    """))
    assert "head_dim" in errs[0].message and "already 3" in errs[0].message


def test_attention_divisibility_error():
    errs = errors(model_text("""
        input x : f32[batch, seq, hidden]
        output y = attention(x, heads = heads)
    """, dims="dim batch = 4, seq = 8, hidden = 16, heads = 3"))
    assert errs[0].message == "hidden = 16 does not divide evenly over heads = 3"
    assert errs[0].hint.startswith("use heads = 4")


def test_mlp_expansion_and_naming():
    m = load(model_text("""
        dim ffn = 32
        input x : f32[batch, hidden]
        output y = mlp(x, ffn, activation = silu)
    """)).model()
    assert [p.name for p in m.params] == [
        "mlp0.linear0.weight", "mlp0.linear0.bias", "mlp0.linear1.weight", "mlp0.linear1.bias"]
    assert [(o.kind, o.args, o.out, o.type.dims) for o in m.ops] == [
        ("einsum", ("x", "mlp0.linear0.weight"), "mlp0.linear0.mm", ("batch", "ffn")),
        ("add", ("mlp0.linear0.mm", "mlp0.linear0.bias"), "mlp0.linear0", ("batch", "ffn")),
        ("silu", ("mlp0.linear0",), "mlp0.act", ("batch", "ffn")),
        ("einsum", ("mlp0.act", "mlp0.linear1.weight"), "mlp0.linear1.mm", ("batch", "hidden")),
        ("add", ("mlp0.linear1.mm", "mlp0.linear1.bias"), "y", ("batch", "hidden")),
    ]
    assert {o.layer for o in m.ops} == {"mlp"}


def test_linear_embedding_norms_and_loss():
    m = load(model_text("""
        dim vocab = 10
        input ids : i64[batch, seq]
        e = embedding(ids, vocab -> hidden)
        n = rmsnorm(layernorm(e))
        d = dropout(n, p = 0.25)
        logits = linear(d, hidden -> vocab, bias = false)
        p = softmax(logits)
        output loss = cross_entropy(logits, ids)
        output p
    """)).model()
    by = {o.out: o for o in m.ops}
    assert by["e"].kind == "embedding" and by["e"].attrs == (("hidden", "hidden"),
                                                            ("vocab", "vocab"))
    assert by["e"].type == ir.TensorType("f32", ("batch", "seq", "hidden"))
    assert by["layernorm0"].attrs == (("eps", 1e-5), ("over", "hidden"))
    assert by["n"].kind == "rmsnorm" and by["n"].attrs == (("eps", 1e-6), ("over", "hidden"))
    assert by["d"].attrs == (("p", 0.25),)
    assert by["logits"].kind == "einsum" and by["logits"].args == ("d", "linear0.weight")
    assert by["p"].attrs == (("over", "vocab"),)
    assert by["loss"].type == ir.TensorType("f32", ())
    assert by["loss"].attrs == (("over", "vocab"),)
    assert [o.is_loss for o in m.outputs] == [True, False]
    assert [p.init for p in m.params] == ["normal(0.02)", "ones", "zeros", "ones",
                                          "normal(0.02)"]


def test_binary_ops_broadcast_by_name():
    m = load(model_text("""
        input a : f32[batch, hidden]
        input b : f32[seq, hidden]
        c = a + b
        output d = c * a + b
    """)).model()
    assert [(o.kind, o.args, o.out, o.type.dims) for o in m.ops] == [
        ("add", ("a", "b"), "c", ("batch", "hidden", "seq")),
        ("mul", ("c", "a"), "mul0", ("batch", "hidden", "seq")),
        ("add", ("mul0", "b"), "d", ("batch", "hidden", "seq")),
    ]


def test_repeat_naming_blocks_and_ssa():
    m = load(EXAMPLES / "gpt.par").model()
    assert m.blocks == ("layer.0", "layer.1", "layer.2", "layer.3")
    names = [p.name for p in m.params]
    assert "layer.0.attention0.wq" in names and "layer.0.layernorm1.gamma" in names
    assert "embedding0.table" in names and names[-2:] == ["linear0.weight", "linear0.bias"]
    outs = [o.out for o in m.ops]
    assert len(outs) == len(set(outs))
    assert "layer.0.x" in outs and "layer.0.x.1" in outs and "layer.3.x.1" in outs
    p = {p.name: p for p in m.params}
    assert p["layer.2.mlp0.linear0.weight"].block == "layer.2"
    assert p["embedding0.table"].block is None
    assert {o.block for o in m.ops if o.out.startswith("layer.1.")} == {"layer.1"}
    # every arg is defined before use
    defined = {i.name for i in m.inputs} | set(names)
    for o in m.ops:
        assert set(o.args) <= defined, o
        defined.add(o.out)
    assert m.outputs[0].is_loss and m.outputs[0].value == "loss"


# ---- dims, overrides, includes ---------------------------------------------------------------


def test_dim_arithmetic():
    m = load(model_text("""
        dim head_dim = hidden / heads, two = (seq - 4) / 2, big = hidden * 2 + 1
        input x : f32[batch, big]
        output x
    """)).model()
    d = dict(m.dims)
    assert (d["head_dim"], d["two"], d["big"]) == (4, 2, 33)
    errs = errors(model_text("dim bad = hidden / 3\ninput x : f32[batch]\noutput x\n"))
    assert errs[0].message == "16 / 3 does not divide evenly"
    assert "15" in errs[0].hint


def test_dim_overrides():
    spec = load(EXAMPLES / "gpt.par", dims={"seq": 32, "heads": 8})
    d = dict(spec.model().dims)
    assert d["seq"] == 32 and d["seq_k"] == 32 and d["head_dim"] == 4
    errs = errors(str(EXAMPLES / "gpt.par"), dims={"sequ": 32})
    assert "no model declares a dim 'sequ'" in errs[0].message
    assert errs[0].hint == "did you mean 'seq'?"
    # an override can leave a parallel block out (its reasons kept; the others go on)
    spec = load(EXAMPLES / "gpt.par", dims={"ffn": 65})
    refused = [d.message for ds in spec.refused.values() for d in ds]
    assert any("ffn = 65 does not divide over model = 2" in m for m in refused)
    assert spec.parallels and not spec.diagnostics


def test_an_int_argument_may_name_a_dim():
    # examples/gpt2.par: cross_entropy(..., classes = classes), dim classes = vocab
    def classes(**dims):
        spec = load(EXAMPLES / "gpt2.par", dims=dims)
        return next(op for op in spec.model().ops if op.kind == "cross_entropy").attr("classes")

    assert classes() is None and classes(vocab=50257) is None  # all real: no padding
    assert classes(vocab=50304, classes=50257) == 50257  # Megatron's padded vocab
    text = (EXAMPLES / "gpt2.par").read_text().replace("classes = classes)", "classes = clas)")
    errs = errors(text, filename="gpt2.par")
    assert errs[0].message == "argument 'classes' must be a number or a dim"


def test_include_and_cycles(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.par").write_text(model_text("input x : f32[batch, hidden]\n"
                                                          "output x\n"))
    (tmp_path / "layouts.par").write_text(
        'include "models/m.par"\n'
        "parallel dp for m on mesh(data = 2) { sample batch -> data }\n")
    spec = load(tmp_path / "layouts.par")
    assert list(spec.models) == ["m"] and list(spec.parallels) == ["dp"]
    # diamond includes are fine
    (tmp_path / "both.par").write_text('include "layouts.par"\ninclude "models/m.par"\n')
    assert list(load(tmp_path / "both.par").models) == ["m"]
    (tmp_path / "a.par").write_text('include "b.par"\n')
    (tmp_path / "b.par").write_text('\ninclude "a.par"\n')
    errs = errors(str(tmp_path / "a.par"))
    assert errs[0].message == "include cycle: a.par -> b.par -> a.par"
    assert (errs[0].line, errs[0].col) == (2, 9)
    errs = errors(str(tmp_path / "b.par"))
    assert "include cycle" in errs[0].message
    (tmp_path / "c.par").write_text('include "nope.par"\n')
    assert "cannot include 'nope.par'" in errors(str(tmp_path / "c.par"))[0].message


# ---- parallel blocks ---------------------------------------------------------------------------


def test_parallel_ir():
    spec = load(EXAMPLES / "gpt.par")
    p = spec.parallel("gpt8")
    assert p.mesh == (("pipe", 2), ("data", 2), ("model", 2)) and p.world_size == 8
    assert p.sample == (("batch", "data"),)
    assert p.attribute == (("seq", "model"),)
    assert p.parameter == (("heads", "model"), ("ffn", "model"), ("vocab", "model"))
    assert [(s.blocks, s.axis, s.stage) for s in p.operator] == [
        (("layer.0", "layer.1"), "pipe", 0), (("layer.2", "layer.3"), "pipe", 1)]
    assert p.schedule == ir.Schedule("1f1b", 4, 1) and p.zero == 1
    assert spec.parallel("single").world_size == 1
    assert spec.parallel("cp2").attribute == (("seq", "cp"),)


def test_interleaved_schedule():
    text = (EXAMPLES / "gpt.par").read_text().split("parallel single")[0] + """
parallel il for gpt on mesh(pipe = 2) {
  operator layer[0] -> pipe 0, layer[1] -> pipe 1, layer[2] -> pipe 0, layer[3] -> pipe 1
  schedule interleaved, microbatches = 4, chunks = 2
}
"""
    p = load(text).parallel("il")
    assert p.schedule == ir.Schedule("interleaved", 4, 2)
    assert [s.stage for s in p.operator] == [0, 1, 0, 1]


def test_several_errors_in_one_run():
    errs = errors(model_text("""
        input x : f32[batch, hiden]
        y = linaer(x, hidden -> seq)
        output z
    """))
    assert [(e.line, e.message) for e in errs] == [
        (4, "unknown dim 'hiden'"), (5, "unknown layer 'linaer'"), (6, "unknown name 'z'")]


def test_error_format():
    text = "model m {\n  dim a = 4\n  input x : f32[a]\n  output y = relu(xx)\n}\n"
    with pytest.raises(SpecError) as e:
        load(text, filename="t.par")
    assert str(e.value) == (
        "t.par:4:19: error: unknown name 'xx'\n"
        "      output y = relu(xx)\n"
        "                      ^^\n"
        "hint: did you mean 'x'?")


def test_spec_api():
    spec = load(EXAMPLES / "mlp.par")
    assert spec.model().name == "mlp" and spec.model("mlp") is spec.models["mlp"]
    assert spec.check() is spec
    with pytest.raises(SpecError, match="did you mean 'tp2'"):
        spec.parallel("tp3")
    with pytest.raises(SpecError):
        spec.model("nope")
    lazy = load("model m {\n dim a = 2\n input x : f32[b]\n output x\n}", check=False)
    assert lazy.models == {} and lazy.diagnostics
    with pytest.raises(SpecError):
        lazy.check()


# ---- custom layers -----------------------------------------------------------------------------


@pytest.fixture
def layers():
    reg = custom.LayerRegistry()
    custom.load_plugin(str(EXAMPLES / "custom_layer.py"), layers=reg)
    return reg


def test_custom_layer(layers):
    swiglu = layers.get("swiglu")
    assert swiglu.kind == "custom:swiglu" and swiglu.shard_mode("ffn") == "partial"
    assert callable(swiglu.fn) and [p.name for p in swiglu.params] == ["w1", "w3", "w2"]
    m = load(EXAMPLES / "swiglu.par", layers=layers).model()
    op = next(o for o in m.ops if o.kind == "custom:swiglu")
    assert op.args == ("layer.0.rmsnorm1", "layer.0.swiglu0.w1", "layer.0.swiglu0.w3",
                       "layer.0.swiglu0.w2")
    assert op.type.dims == ("batch", "seq", "hidden") and op.out == "layer.0.swiglu0"
    assert op.attrs == (("ffn", "ffn"), ("hidden", "hidden"))
    assert op.shard == (("ffn", "partial"),)  # the compiler reads this, not a registry
    p = {p.name: p for p in m.params}
    assert p["layer.1.swiglu0.w2"].type.dims == ("ffn", "hidden")
    errs = errors(model_text("input x : f32[batch, hidden]\noutput y = swiglu(x)\n"),
                  layers=layers)
    assert "missing argument 'ffn'" in errs[0].message
    assert layers.functions() == {"swiglu": swiglu.fn}


def test_custom_layers_live_in_the_registry_passed_in(layers):
    # loading a plugin into one registry leaves the others (the default one too) alone
    before = custom.registered()
    other = custom.LayerRegistry()
    custom.load_plugin(str(EXAMPLES / "custom_layer.py"), layers=other)
    other.remove("swiglu")
    assert layers.get("swiglu") and other.registered() == {} and custom.registered() == before
    errs = errors(EXAMPLES / "swiglu.par", layers=other)
    assert errs[0].message == "unknown layer 'swiglu'" and "--plugin" in errs[0].hint
    # a plugin imported before (a module name) still fills a new registry
    sys.path.insert(0, str(EXAMPLES))
    try:
        for _ in range(2):
            reg = custom.LayerRegistry()
            custom.load_plugin("custom_layer", layers=reg)
            assert list(reg.registered()) == ["swiglu"]
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.modules.pop("custom_layer", None)
    # the decorator of a registry adds to it only
    @other.layer("double", inputs=["x[...]"], output="[...]")
    def double(x):
        return 2 * x

    assert list(other.registered()) == ["double"] and "double" not in custom.registered()
    assert load(model_text("input x : f32[batch, hidden]\noutput y = double(x)\n"),
                layers=other).model().ops[0].kind == "custom:double"


def test_custom_layer_validation():
    with pytest.raises(ValueError, match="built-in"):
        dsl.layer("mlp", inputs=["x[...]"], output="[...]")(lambda x: x)
    with pytest.raises(ValueError, match="needs 'out' in the output"):
        dsl.layer("bad", inputs=["x[..., h]"], output="[..., h]", dims=("out",),
                  params={"w": ("[h, out]", "zeros")}, shard={"out": "split"})(lambda x: x)
    with pytest.raises(ValueError, match="bound by no input"):
        dsl.layer("bad", inputs=["x[..., h]"], output="[..., k]")(lambda x: x)
    with pytest.raises(KeyError):
        custom.get("bad")
    # a UserError (exit 2 from a command) that is still the ValueError it was
    with pytest.raises(custom.LayerError, match="name each dim once"):
        custom.parse_pattern("x[h, h]", "an input")


def test_a_layer_function_that_cannot_take_its_arguments_is_refused_at_the_decorator():
    """The runtime calls fn(inputs..., params...): a function of another arity was registered
    and failed at the first forward with a TypeError from deep inside the runtime; a value
    that is no function failed with an AttributeError; a lone string as `inputs` or a list as
    `params` with errors about what it had been read as."""
    reg = custom.LayerRegistry()
    sig = {"inputs": ["x[..., h]"], "params": {"w": ("[h, f]", "zeros"), "v": ("[f, h]", "zeros")},
           "output": "[..., h]", "dims": ("f",)}
    for fn, said in ((lambda x, w: x, r"its function <lambda>\(x, w\) cannot take the layer's "
                                      r"3 arguments \(too many "),
                     (lambda x, w, v, u: x, r".* 3 arguments \(missing a required argument: 'u'"),
                     (None, r"@layer decorates NoneType None; decorate a function")):
        with pytest.raises(custom.LayerError, match=r"^layer lin: " + said) as e:
            reg.layer("lin", **sig)(fn)
        assert "lin(x, w, v)" in str(e.value) and reg.registered() == {}
    for bad, said in (({"inputs": "x[..., h]"}, "inputs='x[..., h]'; give a list of strings"),
                      ({"dims": "f"}, "dims='f'; give a list of strings"),
                      ({"params": {"w": "[h, f]"}}, "params={'w': '[h, f]'}; give a dict of")):
        with pytest.raises(custom.LayerError) as e:
            reg.layer("lin", **{**sig, **bad})
        assert str(e.value).startswith(f"layer lin: {said}"), str(e.value)
    reg.layer("lin", **sig)(lambda *args: args[0])  # any function that binds them is fine
    assert list(reg.registered()) == ["lin"]


def test_a_bad_plugin_layer_is_exit_2_at_its_line(tmp_path):
    plugin = tmp_path / "twice.py"
    plugin.write_text("from soapstone.dsl import layer\n\n\n"
                      "@layer('twice', inputs=['x[..., h]'], output='[..., k]')\n"
                      "def twice(x):\n    return 2 * x\n")
    r = _soapstone("check", str(EXAMPLES / "gpt.par"), "--plugin", str(plugin))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{plugin}:4:1: error: cannot load plugin: layer twice: dims ['k'] are bound by no " \
           "input" in r.stderr and "add them to an input or to dims=" in r.stderr, r.stderr


# ---- command line ------------------------------------------------------------------------------


def test_check_command(capsys, tmp_path):
    bad = tmp_path / "bad.par"
    bad.write_text("model m {\n  dim a = 2\n  input x : f32[a]\n  output y = swish(x)\n}\n")
    assert cli(["check", str(EXAMPLES / "gpt.par"), str(EXAMPLES / "mlp.par")]) == 0
    out = capsys.readouterr().out
    assert "ok: " in out and "(models: gpt, parallels: single, dp2" in out
    assert cli(["check", str(bad)]) == 2
    assert "unknown layer 'swish'" in capsys.readouterr().err
    assert cli(["check", str(EXAMPLES / "gpt.par"), "--dim", "seq"]) == 2
    assert "expected NAME=INTEGER" in capsys.readouterr().err
    assert cli(["check", str(EXAMPLES / "gpt.par"), "--dim", "vocabb=8"]) == 2
    assert "did you mean 'vocab'" in capsys.readouterr().err
    assert cli(["check", "/nonexistent.par"]) == 2
    assert cli(["check", str(EXAMPLES / "gpt.par"), "--plugin", "no_such_module_x"]) == 2


def test_show_command(capsys):
    assert cli(["show", str(EXAMPLES / "gpt.par"), "--parallel", "tp2"]) == 0
    out = capsys.readouterr().out
    assert "layer.0.attention0.q : f32[batch, seq, heads, head_dim] = einsum(" in out
    assert "parameter heads -> model, ffn -> model, vocab -> model" in out
    assert cli(["show", str(EXAMPLES / "gpt.par"), "--json", "--parallel", "gpt8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parallel"]["world_size"] == 8 and data["model"]["name"] == "gpt"
    assert cli(["show", str(EXAMPLES / "gpt.par"), "--parallel", "nope"]) == 2
    assert "no parallel block named 'nope'" in capsys.readouterr().err


def test_the_api_names_a_layout_by_its_block():
    """Spec.parallel(None) is a SpecError listing the blocks (was a TypeError from the
    did-you-mean search)."""
    spec = load(EXAMPLES / "gpt.par")
    with pytest.raises(SpecError, match="(?s)no parallel block named 'None'.*single, dp2"):
        spec.parallel(None)


def test_check_does_not_import_torch():
    code = ("import sys\nfrom soapstone.dsl.cli import main\n"
            f"rc = main(['check', {str(EXAMPLES / 'gpt.par')!r}, {str(EXAMPLES / 'swiglu.par')!r},"
            f" '--plugin', {str(EXAMPLES / 'custom_layer.py')!r}])\n"
            "assert rc == 0, rc\n"
            "assert 'torch' not in sys.modules, 'check imported torch'\n"
            "assert 'numpy' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_cli_exit_code_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.par"
    bad.write_text("model m {\n  x = = 1\n}\n")
    r = subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", "check", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and f"{bad}:2:7: error: unexpected '='" in r.stderr


def _soapstone(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "soapstone.dsl.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_bare_prints_help_unknown_command_exits_2():
    r = _soapstone()
    assert r.returncode == 0 and "usage: soapstone" in r.stdout and "check" in r.stdout
    r = _soapstone("chek", str(EXAMPLES / "gpt.par"))
    assert r.returncode == 2 and "invalid choice: 'chek'" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_dim_override_is_one_error():
    r = _soapstone("check", str(EXAMPLES / "gpt.par"), "--dim", "seq=0")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("error:") == 1, r.stderr
    assert "--dim seq=0: dim sizes are integers >= 1" in r.stderr
    # through the API too: one error naming the flag, and the spec's own size is kept
    errs = errors(str(EXAMPLES / "gpt.par"), dims={"seq": -2})
    assert [e.message for e in errs] == ["--dim seq=-2: dim sizes are integers >= 1"]


def test_failed_dim_declaration_does_not_cascade():
    text = model_text("""\
        dim twice = seq * 2
        input tokens : i64[batch, seq]
        x = embedding(tokens, vocab -> hidden)
        x = attention(x, heads = heads)
        output loss = cross_entropy(linear(x, hidden -> vocab), tokens)
        """, dims="dim batch = 4, seq = 8 - 8, hidden = 16, heads = 4, vocab = 32")
    errs = errors(text)
    assert len(errs) == 1 and "dim 'seq' has size 0" in errs[0].message, errs


def test_parallel_blocks_the_lowering_would_ignore():
    base = (EXAMPLES / "gpt.par").read_text().split("parallel single")[0]
    errs = errors(base + "parallel p for gpt on mesh(data = 2) {\n"
                  "  sample batch -> data\n  attribute seq -> data\n}\n")
    assert len(errs) == 1 and "input 'tokens' [batch, seq] would split both 'batch' and " \
        "'seq' over axis 'data'" in errs[0].message
    errs = errors(base + "parallel p for gpt on mesh(model = 2) {\n"
                  "  parameter hidden, heads -> model\n}\n")
    assert len(errs) == 1 and "'hidden' and 'heads' over axis 'model'" in errs[0].message
    errs = errors(base + "parallel p for gpt on mesh(data = 2) {\n"
                  "  sample batch -> data\n  schedule interleaved, microbatches = 2, chunks = 2\n"
                  "}\n")  # gpipe and 1f1b without stages are gradient accumulation
    assert len(errs) == 1 and "interleaved schedule needs pipeline stages" in errs[0].message
    # the sequence on the tensor axis (which splits parameters) leaves ZeRO nothing to shard
    errs = errors(base + "parallel p for gpt on mesh(model = 2) {\n"
                  "  parameter heads -> model\n  attribute seq -> model\n  zero 1\n}\n")
    assert len(errs) == 1 and "no sample statement" in errs[0].message
    # on its own axis (context parallel) the parameters are whole there: ZeRO shards over it
    load(base + "parallel p for gpt on mesh(cp = 2) {\n  attribute seq -> cp\n  zero 1\n}\n")
    # one mapping per tensor per axis is fine, even with several dims on one axis
    load(base + "parallel p for gpt on mesh(model = 2) {\n"
         "  parameter heads, ffn, vocab -> model\n}\n")


def test_repeat_1000_expands_every_block():
    def model(n: int) -> ir.Model:
        text = (EXAMPLES / "gpt.par").read_text().replace("repeat 4 as", f"repeat {n} as")
        return load(text.split("parallel single")[0]).model()

    one, many = model(1), model(1000)
    per_block = len(model(2).ops) - len(one.ops)
    assert many.blocks == tuple(f"layer.{i}" for i in range(1000))
    assert len(many.ops) == len(one.ops) + 999 * per_block
    assert many.ops[-1].out == one.ops[-1].out


def test_a_rejected_mapping_does_not_cascade():
    # batch = 1 cannot split over data = 2: one error per layout that maps it, and no
    # follow-on "axis used by no statement", "zero without sample" or microbatch errors
    spec = load(EXAMPLES / "gpt.par", dims={"batch": 1}, check=False)
    messages = [d.message for ds in spec.refused.values() for d in ds]  # left out, each
    assert messages == ["batch = 1 does not divide over data = 2"] * 3, messages


def test_an_unused_axis_is_judged_by_the_statements_not_its_name():
    # "pipe" and "model" are names like any other: the same error, the same two fixes
    base = (EXAMPLES / "gpt.par").read_text().split("parallel single")[0]
    for axis in ("pipe", "model", "stage7"):
        errs = errors(base + f"parallel p for gpt on mesh(data = 2, {axis} = 2) {{\n"
                      "  sample batch -> data\n}\n")
        assert [e.message for e in errs] == [f"mesh axis '{axis}' (size 2) is used by no "
                                             "statement"]
        assert f"sample batch -> {axis}" in errs[0].hint
        assert f"operator layer[0..k] -> {axis} 0" in errs[0].hint
    # a model without repeat blocks has no pipeline stages to suggest
    mlp = (EXAMPLES / "mlp.par").read_text().split("\nparallel ")[0]
    errs = errors(mlp + "\nparallel p for mlp on mesh(pipe = 2) {\n  zero 0\n}\n")
    assert len(errs) == 1 and "operator" not in errs[0].hint
