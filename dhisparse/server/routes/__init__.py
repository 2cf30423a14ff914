"""The routes, one module per concern, each adding its routes to the app (`app.py` calls them in
this order): `info.py` (GET /health, /v1/models, /v1/models/{id}, /metrics), `completions.py`
(POST /v1/completions), `chat.py` (POST /v1/chat/completions), `tokens.py` (POST /tokenize,
POST /v1/dhisparse/prefix). What they share: `prepare.py` (the JSON body; tokenizing, fitting
and validating a prompt on a worker thread) and `generate.py` (submitting the engine requests,
then streaming or collecting their outputs)."""
