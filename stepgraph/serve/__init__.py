"""`stepgraph serve`: an OpenAI-compatible HTTP server over the ``Engine`` (needs the serve
extra: starlette, uvicorn, prometheus-client). ``protocol.py`` and ``responses.py`` are pure;
``loop.py`` is the one engine loop, behind ``client.EngineClient`` on a thread (``worker.py``)
or in a process (``proc_worker.py``, ``engine_proc.py``); ``app.py`` is the ASGI app;
``cli.py`` the command. ``docs/serving.md`` follows a request through them. Importing this
package imports none of the extras."""

from __future__ import annotations
