"""Text -> syntax tree (dsl.ast), with lark's errors turned into located SpecErrors."""

from __future__ import annotations

import functools
import importlib.resources

import lark
from lark import Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from soapstone.dsl.lang import ast
from soapstone.dsl.lang.errors import Diagnostic, SpecError
from soapstone.dsl.model.ir import Loc

_PARSER: lark.Lark | None = None

# Readable names for the terminals that are patterns rather than fixed strings.
_TERMINAL_NAMES = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "STRING": 'a string ("...")',
    "PARAM_REF": "a parameter name (e.g. linear0.weight, as `show` prints it)",
    "$END": "end of file",
}


def grammar_text() -> str:
    """The grammar, loaded from the soapstone.grammar package."""
    return importlib.resources.files("soapstone.grammar").joinpath("par.lark").read_text()


def _parser() -> lark.Lark:
    global _PARSER
    if _PARSER is None:
        _PARSER = lark.Lark(grammar_text(), parser="lalr", propagate_positions=True)
    return _PARSER


@functools.lru_cache(maxsize=256)
def _tree(text: str) -> lark.Tree:
    """Lark's tree of `text`, kept: the same files are loaded again and again (a run, its
    explain, the tests' cases), and _Build makes new nodes from it without changing it."""
    return _parser().parse(text)


class Sources:
    """The lines of every file read so far, to quote them in diagnostics."""

    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = {}

    def add(self, file: str, text: str) -> None:
        self.lines[file] = text.splitlines()

    def diag(self, loc: Loc | None, message: str, hint: str | None = None,
             file: str = "") -> Diagnostic:
        if loc is None:
            return Diagnostic(file, 0, 0, message, hint)
        lines = self.lines.get(loc.file, [])
        src = lines[loc.line - 1] if 0 < loc.line <= len(lines) else None
        return Diagnostic(loc.file, loc.line, loc.col, message, hint, src, loc.end_col)


def _tok_loc(file: str, tok: Token) -> Loc:
    end = tok.end_column if tok.end_line == tok.line else None
    return Loc(file, tok.line, tok.column, end)


def _meta_loc(file: str, meta) -> Loc:
    end = meta.end_column if getattr(meta, "end_line", None) == meta.line else None
    return Loc(file, meta.line, meta.column, end)


@v_args(meta=True)
class _Build(Transformer):
    """Lark tree -> dsl.ast nodes."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _l(self, tok: Token) -> Loc:
        return _tok_loc(self.file, tok)

    # ---- top level
    def start(self, meta, items):
        return ast.File(self.file, list(items))

    def include(self, meta, c):
        return ast.Include(c[0][1:-1], self._l(c[0]))

    def model(self, meta, c):
        return ast.ModelDef(str(c[0]), list(c[1:]), self._l(c[0]), self.file)

    # ---- statements
    def dim_decl(self, meta, c):
        return list(c)

    def dim_def(self, meta, c):
        return ast.DimDecl(str(c[0]), c[1], self._l(c[0]))

    def input_decl(self, meta, c):
        dims = [(str(t), self._l(t)) for t in c[2:] if t is not None]
        return ast.InputDecl(str(c[0]), str(c[1]), self._l(c[1]), dims, self._l(c[0]))

    def assign(self, meta, c):
        return ast.Assign(str(c[0]), c[1], self._l(c[0]))

    def repeat(self, meta, c):
        return ast.Repeat(c[0], str(c[1]), list(c[2:]), self._l(c[1]))

    def tie(self, meta, c):
        return ast.Tie(str(c[0]), str(c[1]), self._l(c[0]), self._l(c[1]))

    def output(self, meta, c):
        name, expr, mark = c
        return ast.OutputStmt(
            str(name),
            expr,
            None if mark is None else str(mark),
            self._l(name),
            None if mark is None else self._l(mark),
        )

    # ---- expressions
    def _bin(self, op, meta, c):
        return ast.BinOp(op, c[0], c[1], _meta_loc(self.file, meta))

    def add(self, meta, c):
        return self._bin("+", meta, c)

    def sub(self, meta, c):
        return self._bin("-", meta, c)

    def mul(self, meta, c):
        return self._bin("*", meta, c)

    def div(self, meta, c):
        return self._bin("/", meta, c)

    def neg(self, meta, c):
        return ast.Neg(c[0], _meta_loc(self.file, meta))

    def name(self, meta, c):
        return ast.Name(str(c[0]), self._l(c[0]))

    def int(self, meta, c):
        return ast.Num(int(c[0]), self._l(c[0]))

    def float(self, meta, c):
        return ast.Num(float(c[0]), self._l(c[0]))

    def string(self, meta, c):
        return ast.Str(str(c[0])[1:-1], self._l(c[0]))

    def call(self, meta, c):
        args = [a for a in c[1:] if a is not None]
        return ast.Call(str(c[0]), args, _meta_loc(self.file, meta), self._l(c[0]))

    def kwarg(self, meta, c):
        return ast.Kwarg(str(c[0]), c[1], self._l(c[0]))

    def maparg(self, meta, c):
        return ast.Map(c[0], c[1], _meta_loc(self.file, meta))

    # ---- parallel blocks
    def parallel(self, meta, c):
        name, model = c[0], c[1]
        mesh = [x for x in c[2:] if isinstance(x, tuple)]
        body = [x for x in c[2:] if not isinstance(x, tuple)]
        return ast.ParallelDef(str(name), str(model), self._l(model), mesh, body, self._l(name),
                               self.file)

    def axis_def(self, meta, c):
        return (str(c[0]), int(c[1]), self._l(c[0]))

    def soap(self, meta, c):
        groups = [g[:3] for g in c[1:]]
        balanced = [(g[0], g[1], g[3]) for g in c[1:] if g[3] is not None]
        return ast.Soap(c[0][0], groups, c[0][1], balanced)

    def soap_kind(self, meta, c):
        return (str(c[0]), self._l(c[0]))

    def dim_group(self, meta, c):
        *names, axis, balanced = c
        dims = [(str(t), self._l(t)) for t in names]
        return (dims, str(axis), self._l(axis), None if balanced is None else self._l(balanced))

    def operator(self, meta, c):
        return ast.Operator(list(c), _meta_loc(self.file, meta))

    def stage_def(self, meta, c):
        name, lo, hi, axis, stage = c
        hi_tok = lo if hi is None else hi
        rng = Loc(self.file, lo.line, lo.column, hi_tok.end_column)
        return ast.StageDef(str(name), int(lo), int(hi_tok), str(axis), int(stage), self._l(name),
                            rng, self._l(axis), self._l(stage))

    def branch_def(self, meta, c):
        name, axis, coord = c
        return ast.BranchDef(str(name), str(axis), int(coord), self._l(name), self._l(axis),
                             self._l(coord))

    def schedule(self, meta, c):
        return ast.ScheduleStmt(str(c[0]), self._l(c[0]), list(c[1:]), _meta_loc(self.file, meta))

    def option(self, meta, c):
        return (str(c[0]), int(c[1]), self._l(c[0]))

    def zero(self, meta, c):
        return ast.Zero(int(c[0]), self._l(c[0]))

    def recompute(self, meta, c):
        return ast.Recompute(str(c[0]), self._l(c[0]))

    def offload(self, meta, c):
        return ast.Offload(str(c[0]), self._l(c[0]))

    def overlap(self, meta, c):
        return ast.Overlap(str(c[0]), self._l(c[0]))


def _describe_terminal(name: str) -> str:
    if name in _TERMINAL_NAMES:
        return _TERMINAL_NAMES[name]
    for t in _parser().terminals:
        if t.name == name:
            if t.pattern.type == "str":
                return f"'{t.pattern.value}'"
            return name.lower()
    return name.lower()


def _expected(names) -> str:
    # keywords first, then punctuation, then kinds of token ("a name")
    items = sorted({_describe_terminal(n) for n in names},
                   key=lambda s: (not s[1:2].isalpha(), not s.startswith("'"), s))
    if not items:
        return ""
    if len(items) == 1:
        return f"; expected {items[0]}"
    return "; expected one of " + ", ".join(items)


def _describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "NAME":
        return f"name '{tok}'"
    return f"'{tok}'"


def _syntax_error(err: UnexpectedInput, file: str, text: str, sources: Sources) -> SpecError:
    lines = text.splitlines() or [""]
    hint = None
    if isinstance(err, UnexpectedCharacters):
        ch = text[err.pos_in_stream] if 0 <= err.pos_in_stream < len(text) else "?"
        msg = f"unexpected character {ch!r}"
        loc = Loc(file, err.line, err.column, err.column + 1)
        if ch == '"':
            hint = "strings end on the line they start"
    elif isinstance(err, UnexpectedToken):
        tok = err.token
        msg = "unexpected " + _describe_token(tok) + _expected(err.expected)
        if tok.type == "$END" or tok.line is None or tok.line < 1:
            loc = Loc(file, len(lines), len(lines[-1]) + 1)
            hint = "a '{' was not closed" if "RBRACE" in err.expected else None
        else:
            loc = _tok_loc(file, tok)
            if tok.type == "NAME" and "RBRACE" in err.expected and "EQUAL" not in err.expected:
                hint = "statements in a parallel block: sample, attribute, parameter, " \
                       "operator, schedule, zero, recompute, offload, overlap"
    elif isinstance(err, UnexpectedEOF):
        msg = "unexpected end of file" + _expected(err.expected)
        loc = Loc(file, len(lines), len(lines[-1]) + 1)
    else:  # pragma: no cover - lark has no other kinds
        msg = str(err).splitlines()[0]
        loc = Loc(file, getattr(err, "line", 1) or 1, getattr(err, "column", 1) or 1)
    return SpecError([sources.diag(loc, msg, hint)])


def parse(text: str, file: str = "<string>", sources: Sources | None = None) -> ast.File:
    """Parse one file's text into a syntax tree; raise SpecError on a syntax error."""
    sources = sources if sources is not None else Sources()
    sources.add(file, text)
    try:
        tree = _tree(text)
    except UnexpectedInput as err:
        raise _syntax_error(err, file, text, sources) from None
    try:
        return _Build(file).transform(tree)
    except RecursionError:
        raise SpecError([sources.diag(Loc(file, 1, 1), "expressions nested too deeply")]) from None
