"""Benchmarks of answers: the QA set over held-out texts and the fact-needle generator."""
