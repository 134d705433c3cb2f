"""Semantics of a model: name resolution, layer expansion, shape inference (-> ir.Model).
Parallel blocks are checked in parallel_checker.py. Pure Python; never imports torch.

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

from soapstone.dsl.lang import ast
from soapstone.dsl.lang.errors import Diagnostic, did_you_mean, nearest_divisible
from soapstone.dsl.lang.parser import Sources
from soapstone.dsl.layers.custom import LayerRegistry
from soapstone.dsl.layers.registry import DTYPES, FLOATS, PARAM_DTYPE, REQUIRED, Operand, broadcast
from soapstone.dsl.model.ir import (
    Input,
    Loc,
    Model,
    Op,
    Output,
    Param,
    TensorType,
)
from soapstone.shard.plan.sizes import MAX_DIM, MAX_REPEAT

NAMED_OPS = ("einsum", "add", "mul")  # ops that read their args by dim name, not position


class _Abort(Exception):
    """Stops checking one statement; its diagnostic (if any) is already recorded."""


_POISON = Operand("<error>", "?", ())


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

    def producer(self, value: str) -> Op | None:
        """The op that made `value` (None for inputs and params)."""
        return next((op for op in reversed(self.b.ops) if op.out == value), None)

    def param(self, local: str, dims: tuple[str, ...], init: str) -> Operand:
        b = self.b
        name = f"{self.inst}.{local}"
        b.params.append(Param(name, TensorType(PARAM_DTYPE, dims), init, b.block, None, self.loc))
        b.taken.add(name)
        return Operand(name, PARAM_DTYPE, dims)

    def op(self, kind, args, dims, dtype, attrs=None, name: str | None = None,
           shard=None) -> Operand:
        b = self.b
        out = self.out if name is None else f"{self.inst}.{name}"
        if out in b.taken:
            out = b.fresh(out)
        b.taken.add(out)
        at = tuple(sorted(attrs.items())) if attrs else ()
        sh = tuple(sorted(shard.items())) if shard else ()
        b.ops.append(Op(kind, tuple(a.name for a in args), out, TensorType(dtype, dims), at,
                        b.block, self.layer, self.loc, sh))
        return Operand(out, dtype, dims)

    def call(self, layer: str, *args, final: bool = False, **kwargs) -> Operand:
        if self.counters is None:
            self.counters = {}
        k = self.counters.get(layer, 0)
        self.counters[layer] = k + 1
        inst = f"{self.inst}.{layer}{k}"
        sub = Ctx(self.b, inst, self.out if final else inst, self.layer, self.loc)
        defn = self.b.layers.builtin(layer)
        full = {a.name: a.default for a in defn.args}
        full.update(zip([a.name for a in defn.args], args, strict=False))
        full.update(kwargs)
        return defn.expand(sub, **full)


class ModelBuilder:
    """Checks one `model` block and builds its ir.Model."""

    def __init__(self, mdef: ast.ModelDef, sources: Sources, overrides: dict[str, int],
                 used: set[str], layers: LayerRegistry):
        self.mdef = mdef
        self.sources = sources
        self.layers = layers
        self.overrides = overrides
        self.used = used
        self.diags: list[Diagnostic] = []
        self.dims: dict[str, int] = {}
        self.dim_why: dict[str, str] = {}
        self.bad_dims: set[str] = set()  # declared, but their size failed: no cascade
        self.alias: dict[str, str] = {}
        self.inputs: list[Input] = []
        self.params: list[Param] = []
        self.ops: list[Op] = []
        self.outputs: list[Output] = []
        self.blocks: list[str] = []
        self.repeats: dict[str, tuple[int, Loc]] = {}
        self.vars: dict[str, Operand] = {}
        self.ssa: dict[str, int] = {}
        self.taken: set[str] = set()
        self.scope = ""
        self.block: str | None = None
        self.counters: dict[str, int] = {}
        self.in_repeat = False
        self.ties: list[ast.Tie] = []

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
            if e.id in self.bad_dims:
                raise _Abort  # its own error is already reported
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
        if d.name in self.overrides:
            self.used.add(d.name)
        try:
            size = self.eval_int(d.expr)
            if d.name in self.overrides:
                size = self.overrides[d.name]
            if size < 1:
                self.fail(d.loc, f"dim '{d.name}' has size {size}; sizes must be >= 1")
            if size > MAX_DIM:
                self.fail(d.loc, f"dim '{d.name}' has size {size}; torch's sizes are 64-bit: "
                          f"at most {MAX_DIM}")
        except _Abort:
            # Still declare it (size 1, marked bad) so that its uses don't cascade into
            # "unknown dim" errors; the model is rejected anyway.
            self.dims[d.name] = 1
            self.bad_dims.add(d.name)
            raise
        self.dims[d.name] = size

    # ---- tensors
    def lookup(self, e: ast.Name) -> Operand:
        v = self.vars.get(e.id)
        if v is _POISON:
            raise _Abort
        if v is not None:
            return v
        if e.id in self.dims:
            self.fail(e.loc, f"'{e.id}' is a dim, not a tensor")
        cands = list(self.vars) + [i.name for i in self.inputs]
        self.fail(e.loc, f"unknown name '{e.id}'", did_you_mean(e.id, cands))

    def tensor(self, e, out: str | None = None) -> Operand:
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

    def call(self, c: ast.Call, out: str | None) -> Operand:
        defn = self.layers.builtin(c.func)
        if defn is None:
            cl = self.layers.custom(c.func)
            if cl is not None:
                return self.custom_call(c, cl, out)
            names = self.layers.names()
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
        literal = e.operand if isinstance(e, ast.Neg) else e
        if isinstance(literal, ast.Num) and isinstance(literal.value, int):
            # a literal size: the dim is named after the argument (heads = 8 -> dim heads);
            # checked as a declared dim's size is, before any layer divides by it
            size = -literal.value if literal is not e else literal.value
            if not 1 <= size <= MAX_DIM:
                self.fail(e.loc, f"argument '{argname}' = {size} is no dim size: sizes must be "
                          f">= 1 and at most {MAX_DIM}",
                          f"give {argname} a positive size, or the name of a declared dim")
            return self.derive(argname, size, None, "a literal", e.loc)
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
            if kind == "int" and isinstance(e, ast.Name) and e.id in self.dims:
                return self.dims[e.id]  # a dim's size (--dim scales it): classes = vocab
            self.fail(getattr(e, "loc", None), f"argument '{name}' must be a number"
                      + (" or a dim" if kind == "int" else ""))
        if kind == "choice":
            if isinstance(e, ast.Name) and e.id in choices:
                return e.id
            got = e.id if isinstance(e, ast.Name) else "this"
            self.fail(getattr(e, "loc", None),
                      f"argument '{name}' must be one of {', '.join(choices)}, not '{got}'",
                      did_you_mean(got, choices))
        raise AssertionError(kind)  # pragma: no cover

    def custom_call(self, c: ast.Call, cl, out: str | None) -> Operand:
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
        # how each bound model dim may split goes on the op: the compiler reads no registry
        shard = {binding[var]: how for var, how in cl.shard}
        return ctx.op(cl.kind, ins + params, odims, ins[0].dtype, dict(binding), shard=shard)

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
        elif isinstance(s, ast.Tie):
            if self.in_repeat:
                self.fail(s.loc, "tie statements go outside repeat blocks",
                          "name the params in full: tie layer.0.linear0.weight = ...")
            self.ties.append(s)
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
        self.vars[s.name] = Operand(s.name, s.dtype, dims)
        self.taken.add(s.name)

    def repeat(self, r: ast.Repeat) -> None:
        if self.in_repeat:
            self.fail(r.loc, "repeat blocks do not nest")
        if r.name in self.repeats:
            self.fail(r.loc, f"a repeat named '{r.name}' already exists")
        n = self.eval_int(r.count)
        if n < 1:
            self.fail(getattr(r.count, "loc", r.loc), f"repeat count is {n}; it must be >= 1")
        if n > MAX_REPEAT:  # every instance is unrolled into its own ops
            self.fail(getattr(r.count, "loc", r.loc), f"repeat count is {n}; at most "
                      f"{MAX_REPEAT} instances (each is unrolled into its own ops)")
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
        self.outputs.append(Output(s.name, v.name, is_loss))

    def tie_params(self) -> None:
        """Apply the tie statements (after every param exists): the tied param names its target;
        lowering then uses the target's storage wherever the tied one is read."""
        by_name = {p.name: i for i, p in enumerate(self.params)}
        tied: dict[str, str] = {}
        for t in self.ties:
            try:
                for name, loc in ((t.name, t.loc), (t.target, t.target_loc)):
                    if name not in by_name:
                        self.fail(loc, f"unknown param '{name}'",
                                  did_you_mean(name, by_name) or "`soapstone show` lists them")
                if t.name == t.target:
                    self.fail(t.loc, f"param {t.name} is tied to itself")
                if t.name in tied:
                    self.fail(t.loc, f"param {t.name} is already tied to {tied[t.name]}")
                if t.target in tied or t.name in tied.values():
                    self.fail(t.loc, "ties do not chain: tie every param to the one that keeps "
                              "the storage")
                a, b = self.params[by_name[t.name]], self.params[by_name[t.target]]
                self.check_tie(t, a, b)
                tied[t.name] = t.target
            except _Abort:
                pass
        for name, target in tied.items():
            i = by_name[name]
            p = self.params[i]
            self.params[i] = Param(p.name, p.type, p.init, p.block, target, p.loc)

    def check_tie(self, t: ast.Tie, a: Param, b: Param) -> None:
        """Tied params hold the same dims; another order only where every reader of the tied
        one contracts or broadcasts by dim name (einsum, add, mul), never by position."""
        shape = lambda p: "[" + ", ".join(p.type.dims) + "]"  # noqa: E731
        if sorted(a.type.dims) != sorted(b.type.dims) or a.type.dtype != b.type.dtype:
            self.fail(t.loc, f"tie {t.name} {shape(a)} = {t.target} {shape(b)}: tied params "
                      "need the same dims")
        if a.type.dims != b.type.dims:
            readers = [op for op in self.ops if t.name in op.args]
            bad = next((op for op in readers if op.kind not in NAMED_OPS), None)
            if bad is not None:
                self.fail(t.loc, f"tie {t.name} {shape(a)} = {t.target} {shape(b)}: {bad.kind} "
                          f"reads {t.name} by position, so the dims must be in the same order",
                          f"tie them the other way round: tie {t.target} = {t.name}")

    def build(self) -> Model | None:
        m = self.mdef
        self.stmts(m.body)
        if not self.diags:  # a failed statement leaves params out: no cascade of unknown ones
            self.tie_params()
        if not self.outputs and not self.diags:
            self.diags.append(self.sources.diag(m.loc, f"model '{m.name}' has no output",
                                                "add: output loss = ..."))
        if self.diags:
            return None
        return Model(m.name, tuple(self.dims.items()), tuple(self.inputs), tuple(self.params),
                     tuple(self.ops), tuple(self.outputs), tuple(self.blocks),
                     tuple(self.alias.items()), m.loc)


def check_model(mdef: ast.ModelDef, sources: Sources, overrides: dict[str, int] | None = None,
                used: set[str] | None = None, layers: LayerRegistry | None = None
                ) -> tuple[Model | None, list[Diagnostic]]:
    """Check one model block against `layers` (only the built-ins when None): its ir.Model
    (None on error) and the diagnostics."""
    b = ModelBuilder(mdef, sources, overrides or {}, used if used is not None else set(),
                     layers if layers is not None else LayerRegistry())
    model = b.build()
    return model, b.diags

