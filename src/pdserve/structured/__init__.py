"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF) compiled with llguidance,
validated at the HTTP edge (grammar.py) and matched token by token on TP rank 0 (matchers.py)."""
