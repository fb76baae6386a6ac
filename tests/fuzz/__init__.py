"""Fuzz harnesses over every decoder that reads network bytes (docs/fuzzing.md)."""
