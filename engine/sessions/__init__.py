"""Sessions: the service that makes and keeps them, the in-RAM store, and their snapshots on disk."""
