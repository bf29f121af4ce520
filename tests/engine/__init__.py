"""Tests of engine/."""
