"""An OpenAI-compatible HTTP API over Veil's engine (``veil api`` and the app's switch in
Settings): ``/v1/chat/completions`` (streamed or not), ``/v1/completions``, ``/v1/models``.

Starlette + uvicorn; on 127.0.0.1 unless told otherwise; every request needs the bearer token.
Replies come from the same engine as the app (the organisation's trunk or fully local, at the
privacy setting chosen there), one at a time in arrival order.
"""
