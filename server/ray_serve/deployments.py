"""The Ray Serve application: N `LongdocReplica`s (each the app and engine of `longdoc serve`,
sharing one data folder) behind a `LongdocIngress` that forwards every HTTP request by handle,
with the session it names, to `SessionRouter`."""

import asyncio
import contextlib
import itertools
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Receive, Scope, Send

from engine.errors import LongdocError
from server.errors import error_body, status_of
from server.ray_serve.asgi import ForwardedRequest, ResponseStart, run_asgi
from server.ray_serve.routing import makes_session, session_in, session_prefix
from server.routes.documents import read_body
from server.settings import Settings

log = logging.getLogger(__name__)

REPLICA_HEADER = b"x-longdoc-replica"
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
ATTEMPTS = 3  # an idempotent request meets a dead replica: tried again, on the new owner
UPLOAD_SLACK_BYTES = 64 * 1024  # multipart framing around a document of max_document_bytes
READY_POLL_SECONDS = 0.2
GONE_ERRORS = (RayActorError, ActorUnavailableError)
ROUTER = "server.ray_serve.router:SessionRouter"
INGRESS_MAX_ONGOING = 1024  # Serve's default of 5 would cap the whole service at 5 requests (streams hold theirs)


@dataclass(frozen=True)
class ScaleOut:
    """How many replicas, and what each gets."""

    replicas: int = 2
    min_replicas: int | None = None  # with max_replicas: autoscale between them instead
    max_replicas: int | None = None
    replica_cpus: float = 1.0
    target_ongoing_requests: float = 4.0  # autoscaling: requests in flight a replica should carry
    metrics_targets_dir: Path | None = None  # Prometheus file_sd: one <replica>.json a replica

    def deployment_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"ray_actor_options": {"num_cpus": self.replica_cpus}}
        if self.min_replicas is not None or self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            high = self.max_replicas if self.max_replicas is not None else max(low, self.replicas)
            if not 1 <= low <= high:
                raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {low} and {high}")
            options["autoscaling_config"] = {
                "min_replicas": low,
                "max_replicas": high,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        else:
            if self.replicas < 1:
                raise ValueError("need at least one replica")
            options["num_replicas"] = self.replicas
        return options


def metrics_target(directory: Path, replica: str, host: str, port: int) -> Path:
    """Write the replica's Prometheus file_sd entry (atomically), after removing the entries of
    replicas on this host whose process is gone (killed, so never removed); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    for other in directory.glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError, TypeError):
            entry = json.loads(other.read_text())[0]
            if entry["targets"][0].rsplit(":", 1)[0] == host and not pid_alive(int(entry["labels"]["pid"])):
                other.unlink()
    path = directory / f"{replica}.json"
    entry = [{"targets": [f"{host}:{port}"], "labels": {"replica": replica, "pid": str(os.getpid())}}]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, path)
    return path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LongdocReplica:
    """One replica: `longdoc serve`'s app and engine, run in process on forwarded requests."""

    async def __init__(self, settings: Settings, metrics_targets_dir: Path | None = None) -> None:  # type: ignore[misc]  # Ray awaits an async constructor
        from engine.engine import Engine
        from engine.runtime.worker import set_compute_threads
        from server.app import create_app

        self.name = serve.get_replica_context().replica_id.unique_id
        set_compute_threads(int(float(os.environ.get("OMP_NUM_THREADS") or 1)))
        settings = settings.model_copy(update={"shared_data_dir": True})
        prefix = session_prefix(self.name)
        self.app = create_app(settings, lambda s: Engine(replace(s.engine_config(), session_id_prefix=prefix)))
        self._lifespan = self.app.router.lifespan_context(self.app)
        self._target: Path | None = None
        self._metrics_server: Any = None
        await self._lifespan.__aenter__()
        try:
            await self._wait_ready()
            if metrics_targets_dir is not None:
                self._target = self._serve_metrics(settings.host, metrics_targets_dir)
        except BaseException:
            await self._close()
            raise
        log.info("replica %s ready", self.name)

    async def _wait_ready(self) -> None:
        """Serve routes to a replica once its constructor returns: return once the models are in."""
        state = self.app.state
        while not state.engine.ready:
            if state.load_error:
                raise RuntimeError(f"model loading failed: {state.load_error}")
            await asyncio.sleep(READY_POLL_SECONDS)

    def _serve_metrics(self, host: str, directory: Path) -> Path:
        from prometheus_client import start_http_server
        from ray.util import get_node_ip_address

        server, _ = start_http_server(0, addr=host, registry=self.app.state.metrics.registry)
        self._metrics_server = server
        # what Prometheus can reach
        advertised = get_node_ip_address() if host in ("0.0.0.0", "::") else host  # type: ignore[no-untyped-call]
        return metrics_target(directory, self.name, advertised, server.server_port)

    async def forward(
        self, request: ForwardedRequest, session_id: str | None = None, turn: int | None = None
    ) -> AsyncIterator[Any]:
        """The response to a forwarded request: a `ResponseStart`, then its body chunks."""
        del session_id, turn  # read by the router
        async for item in run_asgi(self.app, request, [(REPLICA_HEADER, self.name.encode())]):
            yield item

    async def check_health(self) -> None:
        if not self.app.state.engine.ready:
            raise RuntimeError("the engine is not ready")

    async def __del__(self) -> None:
        await self._close()

    async def _close(self) -> None:
        if self._target is not None:
            self._target.unlink(missing_ok=True)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        await self._lifespan.__aexit__(None, None, None)


class RelayedResponse(Response):
    """A replica's response, sent as it arrives: its own status and headers, then its chunks."""

    def __init__(self, start: ResponseStart, chunks: AsyncIterator[bytes]) -> None:
        super().__init__(status_code=start.status)
        self.raw_headers = list(start.headers)
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def unavailable(message: str) -> Response:
    """502, not 503: the replica may have done part of the request, so clients must not resend it blindly."""
    body = json.dumps(error_body("replica_unavailable", message)).encode()
    return Response(body, status_code=502, media_type="application/json")


async def relay(stream: Any, start: ResponseStart) -> AsyncIterator[bytes]:
    """The rest of a replica's response; a replica lost mid-stream ends an event stream with an
    `error` event, as the API ends any stream that fails after its 200."""
    try:
        async for chunk in stream:
            yield chunk
    except GONE_ERRORS:
        log.warning("a replica was lost while streaming a response")
        if any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers):
            error = error_body("replica_unavailable", "the replica answering this request stopped; ask again")
            yield f"event: error\ndata: {json.dumps(error)}\n\n".encode()


# no `from __future__ import annotations` in this module: Serve rebuilds the ingress's methods, and
# FastAPI must see `Request` itself, not its name, to hand the request over
ingress_app = FastAPI(title="longdoc ingress", docs_url=None, redoc_url=None, openapi_url=None)


@ingress_app.exception_handler(LongdocError)
async def _refused(request: Request, exc: LongdocError) -> Response:
    """What the ingress refuses itself (a body over the limit) is answered as the replicas would."""
    return JSONResponse(error_body(exc.kind, exc.message), status_code=status_of(exc))


@ingress_app.exception_handler(Exception)
async def _failed(request: Request, exc: Exception) -> Response:
    log.exception("ingress error on %s %s", request.method, request.url.path)
    return JSONResponse(error_body("internal_error", "internal server error"), status_code=500)


@serve.ingress(ingress_app)
class LongdocIngress:
    """Forwards every HTTP request to the replicas, naming the session it is for."""

    def __init__(self, replicas: DeploymentHandle[Any], settings: Settings) -> None:
        self.replicas = replicas.options(stream=True)
        self.new_session_turns = itertools.count()  # the router sends the n-th new session to the replicas in turn
        self.body_limit = max(settings.max_request_bytes, settings.max_document_bytes) + UPLOAD_SLACK_BYTES

    @ingress_app.api_route("/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    async def forward(self, request: Request) -> Response:
        body = await read_body(request, self.body_limit)
        client = request.client
        forwarded = ForwardedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.url.query.encode(),
            headers=list(request.headers.raw),
            body=body,
            client=(client.host, client.port) if client else None,
        )
        session_id = session_in(request.method, forwarded.path, body)
        turn = next(self.new_session_turns) if makes_session(request.method, forwarded.path) else None
        for attempt in range(ATTEMPTS):
            call = self.replicas.forward.remote(forwarded, session_id=session_id, turn=turn)
            stream = cast(DeploymentResponseGenerator[Any], call)
            try:
                start = await stream.__anext__()
            except GONE_ERRORS as exc:
                log.warning("replica lost before answering %s %s: %s", request.method, forwarded.path, type(exc).__name__)
                if request.method in IDEMPOTENT and attempt + 1 < ATTEMPTS:
                    await asyncio.sleep(0.5 * (attempt + 1))
                    continue
                return unavailable("the replica holding this request's session stopped; retry (its sessions are on disk)")
            return RelayedResponse(start, relay(stream, start))
        return unavailable("no replica answered")  # not reached: the last attempt returns above


def build(settings: Settings, scale: ScaleOut) -> Any:
    """The Serve application: `serve.run(build(...))`."""
    if not settings.persist_sessions:
        raise ValueError("replicas share their sessions through data_dir: persist_sessions must stay true")
    replica = serve.deployment(
        name="LongdocReplica",
        request_router_config=RequestRouterConfig(request_router_class=ROUTER),  # type: ignore[arg-type]  # Ray types **kwargs as dict
        max_ongoing_requests=max(8, settings.max_queue),
        health_check_period_s=5,
        **scale.deployment_options(),
    )(LongdocReplica)
    ingress = serve.deployment(
        name="LongdocIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_MAX_ONGOING
    )(LongdocIngress)
    return ingress.bind(replica.bind(settings, scale.metrics_targets_dir), settings)


def app_builder(args: dict[str, Any]) -> Any:
    """For a Serve config file (deploy/ray/serve.yaml, a KubeRay RayService): `args` hold the
    scale-out fields; the server's settings come from LONGDOC_* variables of the runtime env."""
    fields = {k: v for k, v in args.items() if k in ScaleOut.__dataclass_fields__}
    if fields.get("metrics_targets_dir") is not None:
        fields["metrics_targets_dir"] = Path(fields["metrics_targets_dir"])
    return build(Settings(), ScaleOut(**fields))
