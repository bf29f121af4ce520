"""HTTP layer: FastAPI app, schemas, routes, settings, metrics. Never imports torch or faiss."""
