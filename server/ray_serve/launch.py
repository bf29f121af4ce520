"""`longdoc serve-ray`: start (or join) a Ray cluster, run the application, wait for a signal."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from server.settings import Settings

log = logging.getLogger(__name__)


def run(
    settings: Settings,
    ray_address: str | None,
    replicas: int,
    min_replicas: int | None,
    max_replicas: int | None,
    replica_cpus: float,
    metrics_targets_dir: Path | None,
) -> None:
    import ray
    from ray import serve

    from server.ray_serve.deployments import ScaleOut, build

    scale = ScaleOut(replicas, min_replicas, max_replicas, replica_cpus, metrics_targets_dir=metrics_targets_dir)
    app = build(settings, scale)  # checks the options before anything starts
    logging.basicConfig(level=settings.log_level.upper())
    ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(app, name="longdoc", route_prefix="/", blocking=False)
    log.info("longdoc on Ray Serve: http://%s:%d", settings.host, settings.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()  # type: ignore[no-untyped-call]
    ray.shutdown()
