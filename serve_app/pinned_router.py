"""Serve request router that sends a call to exactly the replica our router chose.

Serve has no built-in "send to replica i". Our router deployment makes the decision (the policy
from `disagg.core`), then calls the engine pool's handle with `replica=<unique id>`; this class,
installed on each engine deployment through `request_router_config`, runs inside that handle
and ranks only the named replica. Serve keeps doing what it does well around it: replica
discovery, `max_ongoing_requests` back-pressure and failure handling.

If the named replica is gone (scaled down or dead between the decision and the call), every
live replica is offered instead, so the request is served rather than stuck; the engine answers
with its own id and the router counts the mismatch (`misrouted`), so a fallback is never silent.
Calls without `replica` (control-plane calls) use any replica.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class PinnedReplicaRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        target = pending_request.kwargs.get("replica") if pending_request is not None else None
        if target is not None:
            for r in candidate_replicas:
                if r.replica_id.unique_id == target:
                    return [[r]]
        return [candidate_replicas]
