"""`stepgraph serve`: an OpenAI-compatible HTTP server over the ``Engine`` (needs the serve
extra: starlette, uvicorn, prometheus-client). ``protocol.py`` and ``responses.py`` are pure;
``worker.py`` runs the engine on its own thread; ``app.py`` is the ASGI app; ``cli.py`` the
command. Importing this package imports none of the extras."""

from __future__ import annotations
