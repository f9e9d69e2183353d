"""Structured outputs: grammar-constrained decoding through llguidance (see grammar.py for
the compiler and a request's matcher, manager.py for the engine core's side)."""
