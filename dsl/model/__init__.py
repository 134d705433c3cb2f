"""The checked model: the named-dim IR, its checkers and its text."""
