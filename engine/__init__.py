"""longdoc engine: models, memories, sessions, workers. Import submodules directly."""
