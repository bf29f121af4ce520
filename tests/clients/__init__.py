"""Tests of clients/."""
