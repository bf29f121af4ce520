"""Hugging Face models the engine serves: the loader, the Neurocache adapter and the segment-selection key/value cache."""
