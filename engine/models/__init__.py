"""Model families and loaders."""
