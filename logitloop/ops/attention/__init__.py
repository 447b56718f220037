"""Attention operators: one dispatch over interchangeable implementations."""
