"""HTTP serving and the engine link, shared by the router and the simulated engine.

* :mod:`~kvevents.http.serving`: binding, starting and stopping a server (uvicorn);
* :mod:`~kvevents.http.inline`: the uvicorn protocol that answers hot routes without ASGI;
* :mod:`~kvevents.http.held_writes`, :mod:`~kvevents.http.deadlines`: writes held until a
  slow client reads, and one timer per event loop for many deadlines;
* :mod:`~kvevents.http.auth`: API keys, TLS and the ASGI type aliases;
* :mod:`~kvevents.http.upstream`: the client the router speaks to engines with; its
  connections, answers and errors in :mod:`~kvevents.http.upstream_connection`,
  :mod:`~kvevents.http.upstream_answers` and :mod:`~kvevents.http.upstream_errors`.
"""
