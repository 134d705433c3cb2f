"""Semantics: name resolution, layer expansion, shape inference (-> ir.Model) and the
validation of parallel blocks (-> ir.Parallel). Pure Python; never imports torch.

Naming (deterministic; it appears in golden files and checkpoint keys):
- scope: "" at top level, "<repeat>.<i>." inside a repeat instance (block "<repeat>.<i>").
- layer instance: "<scope><layer><k>", k counting calls of that layer kind in the scope
  (`layer.0.attention0`, `layer.0.layernorm1`, `embedding0`); a sub-layer adds its own level
  (`layer.0.mlp0.linear1`). Operators `+`/`*` count as `add`/`mul`.
- params: "<instance>.<param>" (`layer.0.attention0.wq`, `embedding0.table`).
- values: an assigned variable is "<scope><var>", then "<scope><var>.1", ... on reassignment;
  a layer's result not assigned directly is named after its instance (`layer.0.layernorm0`);
  its intermediates are "<instance>.<local>" (`layer.0.attention0.q`).
"""

from __future__ import annotations

from . import ast
from . import custom as _custom
from .errors import Diagnostic, did_you_mean, nearest_divisible
from .ir import (
    Branch,
    Input,
    Loc,
    Model,
    Op,
    Output,
    Parallel,
    Param,
    Schedule,
    StageAssignment,
    TensorType,
)
from .layers import DTYPES, FLOATS, LAYERS, PARAM_DTYPE, REQUIRED, Value, broadcast
from .parser import Sources

SCHEDULES = ("gpipe", "1f1b", "interleaved")
SCHEDULE_OPTIONS = ("microbatches", "chunks")


class _Abort(Exception):
    """Stops checking one statement; its diagnostic (if any) is already recorded."""


_POISON = Value("<error>", "?", ())


class Ctx:
    """The expansion context of one layer call (see dsl.layers for the interface)."""

    __slots__ = ("b", "inst", "out", "layer", "loc", "counters")

    def __init__(self, builder: ModelBuilder, inst: str, out: str, layer: str, loc: Loc):
        self.b = builder
        self.inst = inst
        self.out = out
        self.layer = layer
        self.loc = loc
        self.counters: dict[str, int] | None = None

    def error(self, message: str, hint: str | None = None):
        self.b.fail(self.loc, message, hint)

    def size(self, dim: str) -> int:
        return self.b.dims[dim]

    def derive(self, dim: str, size: int, alias_of: str | None = None, why: str = "") -> str:
        return self.b.derive(dim, size, alias_of, why, self.loc)

    def param(self, local: str, dims: tuple[str, ...], init: str) -> Value:
        b = self.b
        name = f"{self.inst}.{local}"
        b.params.append(Param(name, TensorType(PARAM_DTYPE, dims), init, b.block, None, self.loc))
        b.taken.add(name)
        return Value(name, PARAM_DTYPE, dims)

    def op(self, kind, args, dims, dtype, attrs=None, name: str | None = None) -> Value:
        b = self.b
        out = self.out if name is None else f"{self.inst}.{name}"
        if out in b.taken:
            out = b.fresh(out)
        b.taken.add(out)
        at = tuple(sorted(attrs.items())) if attrs else ()
        b.ops.append(Op(kind, tuple(a.name for a in args), out, TensorType(dtype, dims), at,
                        b.block, self.layer, self.loc))
        return Value(out, dtype, dims)

    def call(self, layer: str, *args, final: bool = False, **kwargs) -> Value:
        if self.counters is None:
            self.counters = {}
        k = self.counters.get(layer, 0)
        self.counters[layer] = k + 1
        inst = f"{self.inst}.{layer}{k}"
        sub = Ctx(self.b, inst, self.out if final else inst, self.layer, self.loc)
        defn = LAYERS[layer]
        full = {a.name: a.default for a in defn.args}
        full.update(zip([a.name for a in defn.args], args, strict=False))
        full.update(kwargs)
        return defn.expand(sub, **full)


class ModelBuilder:
    """Checks one `model` block and builds its ir.Model."""

    def __init__(self, mdef: ast.ModelDef, sources: Sources, overrides: dict[str, int],
                 used: set[str]):
        self.mdef = mdef
        self.sources = sources
        self.overrides = overrides
        self.used = used
        self.diags: list[Diagnostic] = []
        self.dims: dict[str, int] = {}
        self.dim_why: dict[str, str] = {}
        self.alias: dict[str, str] = {}
        self.inputs: list[Input] = []
        self.params: list[Param] = []
        self.ops: list[Op] = []
        self.outputs: list[Output] = []
        self.blocks: list[str] = []
        self.repeats: dict[str, tuple[int, Loc]] = {}
        self.vars: dict[str, Value] = {}
        self.ssa: dict[str, int] = {}
        self.taken: set[str] = set()
        self.scope = ""
        self.block: str | None = None
        self.counters: dict[str, int] = {}
        self.in_repeat = False

    # ---- errors and names
    def fail(self, loc: Loc | None, message: str, hint: str | None = None):
        self.diags.append(self.sources.diag(loc, message, hint, self.mdef.file))
        raise _Abort

    def fresh(self, base: str) -> str:
        n = self.ssa.get(base, 0)
        while True:
            n += 1
            name = f"{base}.{n}"
            if name not in self.taken:
                self.ssa[base] = n
                return name

    def ssa_name(self, var: str) -> str:
        base = self.scope + var
        if base in self.taken:
            return self.fresh(base)
        return base

    def instance(self, kind: str) -> str:
        k = self.counters.get(kind, 0)
        self.counters[kind] = k + 1
        return f"{self.scope}{kind}{k}"

    def derive(self, dim, size, alias_of, why, loc) -> str:
        have = self.dims.get(dim)
        if have is None:
            self.dims[dim] = size
            self.dim_why[dim] = why
            if alias_of is not None:
                self.alias[dim] = alias_of
        elif have != size:
            self.fail(loc, f"derived dim {dim} = {why} = {size}, but {dim} is already {have}",
                      f"rename the declared dim {dim}, or make it {size}")
        elif alias_of is not None and self.alias.get(dim, alias_of) != alias_of:
            self.fail(loc, f"dim {dim} already renames {self.alias[dim]}, not {alias_of}")
        return dim

    # ---- dims
    def eval_int(self, e) -> int:
        if isinstance(e, ast.Num):
            if isinstance(e.value, float):
                self.fail(e.loc, f"dim sizes are integers, got {e.value}")
            return e.value
        if isinstance(e, ast.Name):
            if e.id in self.dims:
                return self.dims[e.id]
            self.fail(e.loc, f"unknown dim '{e.id}'", did_you_mean(e.id, self.dims))
        if isinstance(e, ast.Neg):
            return -self.eval_int(e.operand)
        if isinstance(e, ast.BinOp):
            a, b = self.eval_int(e.left), self.eval_int(e.right)
            if e.op == "+":
                return a + b
            if e.op == "-":
                return a - b
            if e.op == "*":
                return a * b
            if b == 0:
                self.fail(e.loc, "division by zero in a dim size")
            if a % b:
                self.fail(e.loc, f"{a} / {b} does not divide evenly",
                          f"dim sizes are integers; {nearest_divisible(a, b)}")
            return a // b
        self.fail(getattr(e, "loc", None), "expected a dim size (an integer expression)")

    def dim_decl(self, d: ast.DimDecl) -> None:
        if d.name in self.dims:
            self.fail(d.loc, f"dim '{d.name}' is declared twice")
        if d.name in self.vars:
            self.fail(d.loc, f"'{d.name}' is already a tensor")
        size = self.eval_int(d.expr)
        if d.name in self.overrides:
            self.used.add(d.name)
            size = self.overrides[d.name]
        if size < 1:
            self.fail(d.loc, f"dim '{d.name}' has size {size}; sizes must be >= 1")
        self.dims[d.name] = size

    # ---- tensors
    def lookup(self, e: ast.Name) -> Value:
        v = self.vars.get(e.id)
        if v is _POISON:
            raise _Abort
        if v is not None:
            return v
        if e.id in self.dims:
            self.fail(e.loc, f"'{e.id}' is a dim, not a tensor")
        cands = list(self.vars) + [i.name for i in self.inputs]
        self.fail(e.loc, f"unknown name '{e.id}'", did_you_mean(e.id, cands))

    def tensor(self, e, out: str | None = None) -> Value:
        """Evaluate a tensor expression; `out` names its result (else a fresh instance name)."""
        if isinstance(e, ast.Name):
            return self.lookup(e)
        if isinstance(e, ast.Call):
            return self.call(e, out)
        if isinstance(e, ast.BinOp):
            if e.op not in "+*":
                self.fail(e.loc, f"tensors support only + and *, not '{e.op}'",
                          "'-' and '/' work on dim sizes")
            a = self.tensor(e.left)
            b = self.tensor(e.right)
            kind = "add" if e.op == "+" else "mul"
            inst = self.instance(kind)
            ctx = Ctx(self, inst, out or inst, kind, e.loc)
            return broadcast(ctx, kind, a, b)
        what = {ast.Num: "a number", ast.Str: "a string", ast.Map: "a dim mapping",
                ast.Neg: "a negation"}.get(type(e), "this")
        self.fail(getattr(e, "loc", None), f"expected a tensor, got {what}")

    def call(self, c: ast.Call, out: str | None) -> Value:
        defn = LAYERS.get(c.func)
        if defn is None:
            cl = _custom._REGISTRY.get(c.func)
            if cl is not None:
                return self.custom_call(c, cl, out)
            names = list(LAYERS) + list(_custom._REGISTRY)
            plugin = "custom layers are registered in Python and loaded with --plugin"
            close = did_you_mean(c.func, names)
            hint = f"{close} ({plugin})" if close else plugin
            self.fail(c.func_loc, f"unknown layer '{c.func}'", hint)
        bound = self.bind(c, defn.args)
        vals = {}
        for a in defn.args:
            got = bound.get(a.name, REQUIRED)
            if got is REQUIRED:
                vals[a.name] = a.default
            else:
                vals[a.name] = self.arg(a.name, a.kind, got, a.choices, c.func)
        inst = self.instance(c.func)
        ctx = Ctx(self, inst, out or inst, c.func, c.loc)
        return defn.expand(ctx, **vals)

    def bind(self, c: ast.Call, sig) -> dict:
        names = [a.name for a in sig]
        bound: dict = {}
        pos = 0
        kw_seen = False
        for a in c.args:
            if isinstance(a, ast.Kwarg):
                kw_seen = True
                if a.name not in names:
                    self.fail(a.loc, f"{c.func}() has no argument '{a.name}'",
                              did_you_mean(a.name, names) or f"arguments: {', '.join(names)}")
                if a.name in bound:
                    self.fail(a.loc, f"argument '{a.name}' of {c.func}() is given twice")
                bound[a.name] = a.value
            else:
                if kw_seen:
                    self.fail(a.loc, "a positional argument follows a keyword argument")
                if pos >= len(names):
                    self.fail(a.loc, f"{c.func}() takes {len(names)} arguments "
                              f"({', '.join(names)}), got more")
                bound[names[pos]] = a
                pos += 1
        for a in sig:
            if a.default is REQUIRED and a.name not in bound:
                self.fail(c.func_loc, f"{c.func}() is missing argument '{a.name}'",
                          f"{c.func}({', '.join(names)})")
        return bound

    def dim_name(self, e, argname: str) -> str:
        if isinstance(e, ast.Name):
            if e.id in self.dims:
                return e.id
            self.fail(e.loc, f"unknown dim '{e.id}'", did_you_mean(e.id, self.dims))
        if isinstance(e, ast.Num) and isinstance(e.value, int):
            # a literal size: the dim is named after the argument (heads = 8 -> dim heads)
            return self.derive(argname, e.value, None, "a literal", e.loc)
        self.fail(getattr(e, "loc", None), f"argument '{argname}' must name a dim")

    def arg(self, name: str, kind: str, e, choices, func: str):
        if kind == "tensor":
            return self.tensor(e)
        if kind == "dim":
            return self.dim_name(e, name)
        if kind == "map":
            if not isinstance(e, ast.Map):
                self.fail(getattr(e, "loc", None),
                          f"argument '{name}' of {func}() must map dims: in_dim -> out_dim")
            return (self.dim_name(e.src, name), self.dim_name(e.dst, name))
        if kind == "bool":
            if isinstance(e, ast.Name) and e.id in ("true", "false"):
                return e.id == "true"
            self.fail(getattr(e, "loc", None), f"argument '{name}' must be true or false")
        if kind in ("float", "int"):
            neg = isinstance(e, ast.Neg)
            inner = e.operand if neg else e
            if isinstance(inner, ast.Num) and (kind == "float" or isinstance(inner.value, int)):
                v = -inner.value if neg else inner.value
                return float(v) if kind == "float" else v
            self.fail(getattr(e, "loc", None), f"argument '{name}' must be a number")
        if kind == "choice":
            if isinstance(e, ast.Name) and e.id in choices:
                return e.id
            got = e.id if isinstance(e, ast.Name) else "this"
            self.fail(getattr(e, "loc", None),
                      f"argument '{name}' must be one of {', '.join(choices)}, not '{got}'",
                      did_you_mean(got, choices))
        raise AssertionError(kind)  # pragma: no cover

    def custom_call(self, c: ast.Call, cl, out: str | None) -> Value:
        sig = [(p.name, "tensor") for p in cl.inputs] + [(d, "dim") for d in cl.dims]

        class _A:  # the bind() protocol
            def __init__(self, name):
                self.name, self.default = name, REQUIRED

        bound = self.bind(c, [_A(n) for n, _ in sig])
        ins = [self.tensor(bound[p.name]) for p in cl.inputs]
        binding: dict[str, str] = {d: self.dim_name(bound[d], d) for d in cl.dims}
        lead: tuple[str, ...] | None = None
        for pat, v in zip(cl.inputs, ins, strict=False):
            n = len(pat.dims)
            if len(v.dims) < n or (not pat.ellipsis and len(v.dims) != n):
                self.fail(c.loc, f"{c.func}() input {pat.name} must look like {pat}, "
                          f"got [{', '.join(v.dims)}]")
            if v.dtype not in FLOATS:
                self.fail(c.loc, f"{c.func}() input {pat.name} must be a float tensor")
            got = v.dims[len(v.dims) - n:]
            for var, d in zip(pat.dims, got, strict=False):
                if binding.setdefault(var, d) != d:
                    self.fail(c.loc, f"{c.func}(): dim variable {var} is {binding[var]} in one "
                              f"place and {d} in another")
            if pat.ellipsis and lead is None:
                lead = v.dims[: len(v.dims) - n]
        inst = self.instance(c.func)
        ctx = Ctx(self, inst, out or inst, cl.kind, c.loc)
        params = [ctx.param(p.name, tuple(binding[d] for d in p.shape.dims), p.init)
                  for p in cl.params]
        odims = (lead or ()) + tuple(binding[d] for d in cl.output.dims)
        if len(set(odims)) != len(odims):
            self.fail(c.loc, f"{c.func}() output [{', '.join(odims)}] repeats a dim")
        return ctx.op(cl.kind, ins + params, odims, ins[0].dtype, dict(binding))

    # ---- statements
    def stmts(self, body: list) -> None:
        for s in body:
            try:
                self.stmt(s)
            except _Abort:
                if isinstance(s, ast.Assign):
                    self.vars[s.target] = _POISON

    def stmt(self, s) -> None:
        if isinstance(s, list):  # one `dim` line
            for d in s:
                try:
                    self.dim_decl(d)
                except _Abort:
                    pass
        elif isinstance(s, ast.Assign):
            if s.target in self.dims:
                self.fail(s.loc, f"'{s.target}' is a dim; tensors need another name")
            if isinstance(s.expr, ast.Name):  # an alias, no op
                self.vars[s.target] = self.lookup(s.expr)
            else:
                self.vars[s.target] = self.tensor(s.expr, self.ssa_name(s.target))
        elif isinstance(s, ast.InputDecl):
            self.input(s)
        elif isinstance(s, ast.Repeat):
            self.repeat(s)
        elif isinstance(s, ast.OutputStmt):
            self.output(s)
        else:  # pragma: no cover
            raise AssertionError(type(s))

    def input(self, s: ast.InputDecl) -> None:
        if self.in_repeat:
            self.fail(s.loc, "inputs are declared outside repeat blocks")
        if s.name in self.vars or any(i.name == s.name for i in self.inputs):
            self.fail(s.loc, f"'{s.name}' is already defined")
        if s.name in self.dims:
            self.fail(s.loc, f"'{s.name}' is a dim; inputs need another name")
        if s.dtype not in DTYPES:
            self.fail(s.dtype_loc, f"unknown dtype '{s.dtype}'",
                      did_you_mean(s.dtype, DTYPES) or f"dtypes: {', '.join(DTYPES)}")
        seen = set()
        for d, loc in s.dims:
            if d not in self.dims:
                self.fail(loc, f"unknown dim '{d}'",
                          did_you_mean(d, self.dims) or f"declare it: dim {d} = SIZE")
            if d in seen:
                self.fail(loc, f"dim '{d}' appears twice in one tensor")
            seen.add(d)
        dims = tuple(d for d, _ in s.dims)
        self.inputs.append(Input(s.name, TensorType(s.dtype, dims), s.loc))
        self.vars[s.name] = Value(s.name, s.dtype, dims)
        self.taken.add(s.name)

    def repeat(self, r: ast.Repeat) -> None:
        if self.in_repeat:
            self.fail(r.loc, "repeat blocks do not nest")
        if r.name in self.repeats:
            self.fail(r.loc, f"a repeat named '{r.name}' already exists")
        n = self.eval_int(r.count)
        if n < 1:
            self.fail(getattr(r.count, "loc", r.loc), f"repeat count is {n}; it must be >= 1")
        self.repeats[r.name] = (n, r.loc)
        self.in_repeat = True
        top_counters = self.counters
        try:
            for i in range(n):
                self.block = f"{r.name}.{i}"
                self.scope = self.block + "."
                self.counters = {}
                self.blocks.append(self.block)
                before = len(self.diags)
                self.stmts(r.body)
                if len(self.diags) > before or _POISON in self.vars.values():
                    break  # reported once, for the first instance
        finally:
            self.in_repeat = False
            self.block = None
            self.scope = ""
            self.counters = top_counters

    def output(self, s: ast.OutputStmt) -> None:
        if self.in_repeat:
            self.fail(s.loc, "outputs are declared outside repeat blocks")
        if any(o.name == s.name for o in self.outputs):
            self.fail(s.loc, f"output '{s.name}' is declared twice")
        if s.mark is not None and s.mark != "loss":
            self.fail(s.mark_loc, f"'output ... as {s.mark}': only 'as loss' is known",
                      "write 'as loss' to mark the loss")
        if s.expr is None:
            v = self.lookup(ast.Name(s.name, s.loc))
        elif isinstance(s.expr, ast.Name):
            v = self.lookup(s.expr)
        else:
            v = self.tensor(s.expr, self.ssa_name(s.name))
        self.vars[s.name] = v
        is_loss = (s.mark == "loss" or s.name == "loss") and not any(
            o.is_loss for o in self.outputs)
        if is_loss and (v.dims or v.dtype not in FLOATS):
            self.fail(s.loc, f"the loss must be a float scalar, got {v.dtype}"
                      f"[{', '.join(v.dims)}]", "reduce it, e.g. with cross_entropy")
        self.outputs.append(Output(s.name, v.name, is_loss, s.loc))

    def build(self) -> Model | None:
        m = self.mdef
        self.stmts(m.body)
        if not self.outputs and not self.diags:
            self.diags.append(self.sources.diag(m.loc, f"model '{m.name}' has no output",
                                                "add: output loss = ..."))
        if self.diags:
            return None
        return Model(m.name, tuple(self.dims.items()), tuple(self.inputs), tuple(self.params),
                     tuple(self.ops), tuple(self.outputs), tuple(self.blocks),
                     tuple(self.alias.items()), m.loc)


def check_model(mdef: ast.ModelDef, sources: Sources, overrides: dict[str, int] | None = None,
                used: set[str] | None = None) -> tuple[Model | None, list[Diagnostic]]:
    """Check one model block: its ir.Model (None on error) and the diagnostics."""
    b = ModelBuilder(mdef, sources, overrides or {}, used if used is not None else set())
    model = b.build()
    return model, b.diags


# ---- parallel blocks -------------------------------------------------------------------------


class _ParallelChecker:
    def __init__(self, p: ast.ParallelDef, model: Model, sources: Sources):
        self.p = p
        self.m = model
        self.sources = sources
        self.diags: list[Diagnostic] = []
        self.dims = dict(model.dims)

    def err(self, loc, message, hint=None) -> None:
        self.diags.append(self.sources.diag(loc, message, hint, self.p.file))

    def check(self) -> Parallel | None:
        p, m = self.p, self.m
        mesh: dict[str, int] = {}
        for axis, size, loc in p.mesh:
            if axis in mesh:
                self.err(loc, f"mesh axis '{axis}' is declared twice")
            elif size < 1:
                self.err(loc, f"mesh axis '{axis}' has size {size}; sizes must be >= 1")
            else:
                mesh[axis] = size
        self.mesh = mesh
        used_axes: dict[str, str] = {}  # axis -> what uses it
        mapped: dict[str, tuple[str, str]] = {}  # dim -> (kind, axis)
        soap: dict[str, list[tuple[str, str]]] = {"sample": [], "attribute": [], "parameter": []}
        operator: list[StageAssignment] = []
        branches: list[Branch] = []
        schedule = None
        zero = 0
        seen_kw: dict[str, Loc] = {}
        batch = m.inputs[0].type.dims[0] if m.inputs and m.inputs[0].type.dims else None
        param_dims = {d for prm in m.params for d in prm.type.dims}
        pipe_axis = None
        for s in p.body:
            kw = type(s).__name__
            if isinstance(s, (ast.ScheduleStmt, ast.Zero, ast.Operator)):
                if kw in seen_kw:
                    self.err(s.loc, f"a second '{kw.replace('Stmt', '').lower()}' statement",
                             "put everything in one statement")
                    continue
                seen_kw[kw] = s.loc
            if isinstance(s, ast.Soap):
                for dims, axis, axis_loc in s.groups:
                    axis_ok = self.axis(axis, axis_loc)
                    for d, loc in dims:
                        if d not in self.dims:
                            self.err(loc, f"model '{m.name}' has no dim '{d}'",
                                     did_you_mean(d, self.dims))
                            continue
                        if d in mapped:
                            k, ax = mapped[d]
                            self.err(loc, f"dim '{d}' is already mapped ({k} {d} -> {ax})",
                                     "a dim maps to at most one mesh axis")
                            continue
                        if s.kind == "sample" and d != batch:
                            self.err(loc, f"sample maps the batch dim '{batch}' (the inputs' "
                                     f"leading dim), not '{d}'",
                                     f"use 'attribute {d} -> {axis}' to split a data dim")
                            continue
                        if s.kind == "sample" and soap["sample"]:
                            self.err(loc, "only one sample mapping is allowed")
                            continue
                        if s.kind == "parameter" and d not in param_dims:
                            self.err(loc, f"'{d}' is no dim of any parameter",
                                     f"use 'attribute {d} -> {axis}' to split activations")
                            continue
                        if s.kind == "attribute" and d == batch:
                            self.err(loc, f"'{d}' is the batch dim; split it with sample",
                                     f"sample {d} -> {axis}")
                            continue
                        if not axis_ok:
                            continue
                        size, n = self.dims[d], mesh[axis]
                        if size % n:
                            self.err(loc, f"{d} = {size} does not divide over {axis} = {n}",
                                     f"{nearest_divisible(size, n)} (--dim {d}=...)")
                            continue
                        mapped[d] = (s.kind, axis)
                        soap[s.kind].append((d, axis))
                        used_axes.setdefault(axis, s.kind)
            elif isinstance(s, ast.Operator):
                stage_defs = [d for d in s.stages if not isinstance(d, ast.BranchDef)]
                branch_defs = [d for d in s.stages if isinstance(d, ast.BranchDef)]
                branches = self.branches(branch_defs)
                for d in branch_defs:  # even a bad placement uses its axis: no second error
                    used_axes.setdefault(d.axis, "branch")
                if stage_defs:
                    operator, pipe_axis = self.operator(ast.Operator(stage_defs, s.loc))
                    if pipe_axis:
                        used_axes[pipe_axis] = "operator"
            elif isinstance(s, ast.ScheduleStmt):
                schedule = s
            elif isinstance(s, ast.Zero):
                if not 0 <= s.level <= 3:
                    self.err(s.loc, f"zero {s.level}: the ZeRO stage is 0, 1, 2 or 3")
                else:
                    zero = s.level
        for b in branches:
            if used_axes.get(b.axis) != "branch":
                self.err(b.loc, f"axis '{b.axis}' places branches and cannot also "
                         f"{'hold pipeline stages' if b.axis == pipe_axis else 'split dims'}",
                         "give the branches their own mesh axis")
        for ax in {ax for _, ax in soap["sample"] + soap["attribute"] + soap["parameter"]}:
            if pipe_axis is not None and ax == pipe_axis:
                self.err(seen_kw["Operator"], f"axis '{ax}' holds pipeline stages and cannot "
                         "also split dims", "give the pipeline its own mesh axis")
        for axis, size, loc in p.mesh:
            if size > 1 and axis in mesh and axis not in used_axes:
                if axis.startswith("pipe") or axis.startswith("stage"):
                    self.err(loc, f"mesh axis '{axis}' (size {size}) has no operator statement",
                             f"add: operator <repeat>[0..k] -> {axis} 0, ...")
                else:
                    self.err(loc, f"mesh axis '{axis}' (size {size}) is used by no statement",
                             f"map a dim to it (sample {batch} -> {axis}), or make its size 1")
        sched = Schedule()
        if schedule is not None:
            sched = self.schedule(schedule, soap["sample"], pipe_axis, batch, operator)
        if self.diags:
            return None
        return Parallel(p.name, p.model, tuple(p_ for p_ in mesh.items()),
                        tuple(soap["sample"]), tuple(soap["attribute"]),
                        tuple(soap["parameter"]), tuple(operator), sched, zero, p.loc,
                        tuple(branches))

    def branches(self, defs: list) -> list[Branch]:
        """`operator a -> branch 0`: top-level values assigned once, on an existing axis."""
        m = self.m
        top = {op.out for op in m.ops if op.block is None}
        outputs = {o.value for o in m.outputs}
        out: list[Branch] = []
        seen: set[str] = set()
        for d in defs:
            if d.value in seen:
                self.err(d.loc, f"value '{d.value}' is placed twice")
                continue
            seen.add(d.value)
            if d.value not in top:
                self.err(d.loc, f"'{d.value}' is no top-level value of model '{m.name}'",
                         did_you_mean(d.value, top) or "branches name values assigned "
                         "outside repeat blocks")
                continue
            if f"{d.value}.1" in top:
                self.err(d.loc, f"'{d.value}' is assigned more than once; a branch names "
                         "one value", "give the branch's result its own name")
                continue
            if d.value in outputs:
                self.err(d.loc, f"'{d.value}' is a model output; a branch must feed later ops",
                         "place the ops before the output instead")
                continue
            if not self.axis(d.axis, d.axis_loc):
                continue
            if not 0 <= d.coord < self.mesh[d.axis]:
                self.err(d.coord_loc, f"{d.axis} {d.coord} is out of range: axis '{d.axis}' "
                         f"has size {self.mesh[d.axis]} (0..{self.mesh[d.axis] - 1})")
                continue
            out.append(Branch(d.value, d.axis, d.coord, d.loc))
        return out

    def axis(self, axis: str, loc: Loc) -> bool:
        if axis in self.mesh:
            return True
        self.err(loc, f"mesh has no axis '{axis}'",
                 did_you_mean(axis, self.mesh) or f"axes: {', '.join(self.mesh)}")
        return False

    def operator(self, s: ast.Operator):
        m = self.m
        repeats: dict[str, list[str]] = {}
        for b in m.blocks:
            repeats.setdefault(b.rsplit(".", 1)[0], []).append(b)
        owner: dict[str, tuple[int, Loc]] = {}
        out: list[StageAssignment] = []
        axis = None
        ok = True
        for sd in s.stages:
            if sd.repeat not in repeats:
                self.err(sd.loc, f"model '{m.name}' has no repeat '{sd.repeat}'",
                         did_you_mean(sd.repeat, repeats) or
                         (f"repeats: {', '.join(repeats)}" if repeats else
                          "pipeline stages hold repeat blocks; the model has none"))
                ok = False
                continue
            if axis is None:
                if not self.axis(sd.axis, sd.axis_loc):
                    return [], None
                axis = sd.axis
            elif sd.axis != axis:
                self.err(sd.axis_loc, f"all stages must use one mesh axis ('{axis}')")
                ok = False
                continue
            n = len(repeats[sd.repeat])
            if sd.lo > sd.hi:
                self.err(sd.range_loc, f"empty range [{sd.lo}..{sd.hi}]", "write [low..high]")
                ok = False
                continue
            if sd.hi >= n:
                self.err(sd.range_loc, f"{sd.repeat} has {n} blocks (0..{n - 1}); "
                         f"[{sd.lo}..{sd.hi}] is out of range")
                ok = False
                continue
            if not 0 <= sd.stage < self.mesh[axis]:
                self.err(sd.stage_loc, f"stage {sd.stage} is out of range: axis '{axis}' has "
                         f"{self.mesh[axis]} stages (0..{self.mesh[axis] - 1})")
                ok = False
                continue
            blocks = repeats[sd.repeat][sd.lo: sd.hi + 1]
            for b in blocks:
                if b in owner:
                    self.err(sd.range_loc, f"block {b} is assigned twice",
                             f"it is already on {axis} {owner[b][0]}")
                    ok = False
                owner[b] = (sd.stage, sd.range_loc)
            out.append(StageAssignment(tuple(blocks), axis, sd.stage, sd.loc))
        if not ok or axis is None:
            return out, axis
        missing = [b for b in m.blocks if b not in owner]
        if missing:
            self.err(s.loc, f"block {missing[0]} is assigned to no stage"
                     + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""),
                     "every repeat block goes to exactly one stage")
            return out, axis
        self.stage_seq = [owner[b][0] for b in m.blocks]
        self.stage_locs = [owner[b][1] for b in m.blocks]
        used = set(self.stage_seq)
        empty = [i for i in range(self.mesh[axis]) if i not in used]
        if empty:
            self.err(s.loc, f"{axis} stage {empty[0]} gets no block",
                     "every stage needs at least one block")
        return out, axis

    def order_ok(self, interleaved: bool, chunks: int, nstages: int, loc) -> None:
        seq = getattr(self, "stage_seq", None)
        if not seq:
            return
        runs = [seq[0]] + [b for a, b in zip(seq, seq[1:], strict=False) if a != b]
        if interleaved:
            want = list(range(nstages)) * chunks
            if runs != want:
                self.err(loc, f"interleaved stages must cycle 0..{nstages - 1} {chunks} times "
                         f"over the blocks, got {' '.join(map(str, runs))}",
                         "assign contiguous chunks: layer[0] -> pipe 0, layer[1] -> pipe 1, ...")
            return
        for i in range(len(seq) - 1):
            if seq[i] > seq[i + 1]:
                self.err(self.stage_locs[i + 1], f"block {self.m.blocks[i + 1]} is on stage "
                         f"{seq[i + 1]}, before the stage {seq[i]} of {self.m.blocks[i]}",
                         "stages must follow block order (block i's stage <= block i+1's)")
                return

    def schedule(self, s: ast.ScheduleStmt, sample, pipe_axis, batch, operator) -> Schedule:
        kind = s.kind
        if kind not in SCHEDULES:
            self.err(s.kind_loc, f"unknown schedule '{kind}'",
                     did_you_mean(kind, SCHEDULES) or f"schedules: {', '.join(SCHEDULES)}")
            kind = "1f1b"
        opts: dict[str, int] = {}
        for key, value, loc in s.options:
            if key not in SCHEDULE_OPTIONS:
                self.err(loc, f"unknown schedule option '{key}'",
                         did_you_mean(key, SCHEDULE_OPTIONS) or "options: microbatches, chunks")
            elif key in opts:
                self.err(loc, f"schedule option '{key}' is given twice")
            elif value < 1:
                self.err(loc, f"{key} = {value}; it must be >= 1")
            else:
                opts[key] = value
        mb = opts.get("microbatches", 1)
        chunks = opts.get("chunks", 1)
        loc_of = {k: loc for k, _, loc in s.options}
        nstages = self.mesh.get(pipe_axis, 1) if pipe_axis else 1
        if batch is not None:
            replicas = self.mesh.get(sample[0][1], 1) if sample else 1
            per = self.dims[batch] // replicas
            if per % mb:
                ok = [n for n in range(1, per + 1) if per % n == 0]
                near = min(ok, key=lambda n: (abs(n - mb), n))
                self.err(loc_of.get("microbatches", s.loc),
                         f"microbatches = {mb} does not divide the per-replica batch "
                         f"{batch} / {replicas} = {per}", f"use microbatches = {near}")
        if kind == "interleaved":
            if chunks < 2:
                self.err(loc_of.get("chunks", s.kind_loc),
                         f"interleaved needs chunks >= 2 (got {chunks})",
                         "add: chunks = 2 (virtual stages per rank)")
            if mb % nstages:
                self.err(loc_of.get("microbatches", s.loc),
                         f"interleaved needs microbatches ({mb}) to be a multiple of the "
                         f"stage count ({nstages})")
        elif chunks != 1:
            self.err(loc_of["chunks"], f"chunks applies to the interleaved schedule, not {kind}")
        if operator:
            self.order_ok(kind == "interleaved", chunks, nstages, s.kind_loc)
        return Schedule(kind, mb, chunks)


def check_parallel(p: ast.ParallelDef, model: Model, sources: Sources):
    """Check one parallel block against its (checked) model: (ir.Parallel | None, diagnostics)."""
    c = _ParallelChecker(p, model, sources)
    par = c.check()
    if par is not None and not any(isinstance(s, ast.ScheduleStmt) for s in p.body):
        c.order_ok(False, 1, 1, None)  # order still matters without a schedule statement
        if c.diags:
            par = None
    return par, c.diags
