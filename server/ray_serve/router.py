"""Ray Serve's request router for the replicas: a request that names a session goes to the
replica that owns it (routing.owner_of); a request that makes a session goes to the replicas in
turn (routing.in_turn; the ingress numbers it once), so that sessions, each holding its memory for
as long as it lives, spread evenly rather than by the queue of the moment; any other request goes
by Serve's own power of two choices, to the less loaded of two replicas. The owner, or the turn's
replica, alone is offered: when it is busy the request waits for it, as Serve's router waits,
rather than reach a replica without the session. (A turn that also offered the other replicas let
a session spill over when its replica was full or missed the router's 0.1 s queue-length probe;
a fresh-clone test run on a loaded machine once saw 8 sessions made together land 3 and 5.)"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from server.ray_serve.routing import in_turn, owner_of


class SessionRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        session_id, turn = kwargs.get("session_id"), kwargs.get("turn")
        if not (session_id or turn is not None) or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        assert pending_request is not None
        pending_request.routing_context.should_backoff = True  # a busy replica is probed again after a backoff
        by_name = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if session_id:
            return [[by_name[owner_of(session_id, sorted(by_name))]]]
        assert turn is not None
        return [[by_name[in_turn(turn, list(by_name))]]]
