"""Tests of server/."""
