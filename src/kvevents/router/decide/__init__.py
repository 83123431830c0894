"""The routing decision: the :class:`~kvevents.router.decide.router.Router`, its scoring,
the load board, batches, the model catalog and the native route."""
