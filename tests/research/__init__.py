"""Tests of research/."""
