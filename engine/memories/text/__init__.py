"""The `text` memory: document chunks ranked by fused BM25 and MiniLM scores, handed to the reader as excerpts."""
