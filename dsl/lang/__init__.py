"""The .par language: text -> syntax tree (parser, ast, spec loading, lexer, errors)."""
