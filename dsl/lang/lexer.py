"""A Pygments lexer for `.par` specs, registered as the `par` lexer through the package's
`pygments.lexers` entry point, so `pygmentize -l par FILE`, `pygmentize FILE.par` and
documentation tools (Sphinx, MkDocs) highlight specs. Imported only by Pygments.

The words follow grammar/par.lark: statement keywords, the SOAP kinds, dtypes of inputs,
layer calls (a name before `(`), mesh arrows, numbers, strings and `#` comments.
"""

from __future__ import annotations

from pygments.lexer import RegexLexer, bygroups, words
from pygments.token import (
    Comment,
    Keyword,
    Name,
    Number,
    Operator,
    Punctuation,
    String,
    Text,
    Whitespace,
)

from soapstone.shard.plan.dtypes import DTYPES as SPEC_DTYPES

KEYWORDS = ("include", "model", "dim", "input", "repeat", "as", "output", "tie", "parallel",
            "for", "on", "mesh", "operator", "schedule", "zero", "balanced")
SOAP = ("sample", "attribute", "parameter")
DTYPES = tuple(SPEC_DTYPES)  # the names a spec can use (the one dtype table)


class ParLexer(RegexLexer):
    """soapstone's .par model and layout specs."""

    name = "soapstone par"
    aliases = ["par", "soapstone"]
    filenames = ["*.par"]
    mimetypes = ["text/x-soapstone-par"]

    tokens = {
        "root": [
            (r"[ \t\r\n\f]+", Whitespace),
            (r"#[^\n]*", Comment.Single),
            (r'"[^"\n]*"', String.Double),
            (r"(model|parallel)([ \t]+)([A-Za-z_]\w*)", bygroups(Keyword, Whitespace, Name.Class)),
            (words(KEYWORDS, suffix=r"\b"), Keyword),
            (words(SOAP, suffix=r"\b"), Keyword.Declaration),
            (words(DTYPES, suffix=r"\b"), Keyword.Type),
            (r"(true|false)\b", Keyword.Constant),
            (r"1f1b\b", Name.Builtin),  # the schedule, not a number
            (r"[A-Za-z_]\w*(?=\s*\()", Name.Function),
            (r"[A-Za-z_]\w*(\.\w+)+", Name.Attribute),
            (r"[A-Za-z_]\w*", Name),
            (r"[0-9]+\.[0-9]+([eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+", Number.Float),
            (r"[0-9]+", Number.Integer),
            (r"->|\.\.|[-+*/=:]", Operator),
            (r"[{}()\[\],]", Punctuation),
            (r".", Text),
        ],
    }
