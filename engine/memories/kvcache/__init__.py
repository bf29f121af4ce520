"""The `kvcache` memory: the served model's own keys and values per segment, selected per layer while answering."""
