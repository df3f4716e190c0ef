"""Adapter-affinity routing over engine replicas (rendezvous hashing with bounded load, residency preference,
failover with cool-down)."""
from loraplex.platform.routing.rendezvous import hrw_rank, hrw_score
from loraplex.platform.routing.replica import Replica
from loraplex.platform.routing.router import NoReplicaAvailableError, Router, RouterConfig

__all__ = ["Replica", "Router", "RouterConfig", "NoReplicaAvailableError", "hrw_rank", "hrw_score"]
