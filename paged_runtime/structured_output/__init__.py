"""Structured outputs: an output constraint (JSON schema, regex, choice, EBNF grammar) compiled by xgrammar
into a token-level automaton, and the per-request state that turns it into a token bitmask each step.

``backend``: compile (once per distinct constraint, cached) and report the compiler's message for a bad one.
``grammar``: one request's matcher, kept in step with the request's output tokens by the model runner.
"""
