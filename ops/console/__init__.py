"""The web console, ``intermission console``: a person's view of the pauses waiting on them, and their
decisions, in a browser.

People log in with their RabbitMQ user and password, and the console then acts as that user: their
decisions are published on an AMQP connection opened with their own credentials (so the broker validates
the ``user_id`` every decision carries, and the workers hold each pause's approvers against it), and they
see only the scopes the broker grants them, read through the management API and applied in SQL to every
read (``store/granted.py``).

- ``command.py``: the click command and uvicorn.
- ``app.py``: the Starlette application, its routes and its lifespan.
- ``sessions.py``: logged-in people, each with their connection, grants and decisions, kept in memory.
- ``listener.py``: each session's subscription to its scopes' events, which pushes live updates to the
  browser and tells a decision's outcome.
- ``security.py``: CSRF tokens, response headers, safe redirects.
- ``views.py``: what the templates are given.
- ``templates/``, ``static/``: Jinja2 templates, one CSS file and one small script, served by the app
  itself (nothing is fetched from anywhere else).
"""
