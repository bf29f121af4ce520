"""Training and evaluation: the offline corpus, Neurocache adaptation."""
