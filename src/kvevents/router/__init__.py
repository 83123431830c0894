"""KV-aware routing: scoring, the in-process :class:`Router`, and the HTTP service.

``kvevents router --engine URL`` runs :mod:`kvevents.cli.router`; importing this
package does not import FastAPI.
"""

from kvevents.router.decide.router import RouteDecision, Router, Ticket
from kvevents.router.decide.scoring import HolderLoad, HolderScore, ScoringWeights, choose, score

__all__ = [
    "HolderLoad",
    "HolderScore",
    "RouteDecision",
    "Router",
    "ScoringWeights",
    "Ticket",
    "choose",
    "score",
]
