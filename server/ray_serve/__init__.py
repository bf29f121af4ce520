"""longdoc on Ray Serve: replicas of the same app and engine as `longdoc serve`, behind a thin
ingress that routes each request for a session to the replica that holds it (docs/scale-out.md)."""
