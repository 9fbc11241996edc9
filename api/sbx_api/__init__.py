"""The Cloud Agent Sandbox wire contract, neutral between the server and its clients
(msgspec and the standard library only):

- :mod:`sbx_api.wire`: the REST API's answers (sessions, snapshots, timelines, errors' bodies);
- :mod:`sbx_api.errors`: every error a user can see, with its stable code and HTTP status;
- :mod:`sbx_api.hostapi`: the host API's frames, bodies, limits and checks;
- :mod:`sbx_api.ids`: the identifier rules a client applies before it sends a request.

The gateway's OpenAPI document and the TypeScript client's types are generated from these.
"""
