"""End-to-end tests: a real server process, browser or restart."""
