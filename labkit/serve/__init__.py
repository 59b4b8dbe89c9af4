"""The inference service: OpenAI's HTTP API in front of the serving engine.

    client --HTTP--> app (FastAPI: validation, tokenization, SSE)  --EngineClient-->  engine
                     errors  protocol  responses  metrics              worker (own process)
                                                                       or in process (thread)

`labkit serve` (`server.py`) runs it under uvicorn; `build_app` gives the ASGI app for any
`EngineClient`. `labkit/serve/README.md` documents the routes, fields, defaults and errors.
"""
