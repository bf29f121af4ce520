"""What runs the models: the registry of loaded models, their workers, the decode scheduler and generation."""
