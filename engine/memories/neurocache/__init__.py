"""The `neurocache` memory: compressed hidden states in a kNN cache, read by an adapter's cache attention."""
