"""The engine process's internal HTTP API (``loraplex engine serve``).

    protocol.py   wire types (torch-free, no web stack): GenerateRequest, AdapterSpec, chunk/error dicts
    service.py    EngineService: the engine behind plain async methods (generate, abort, adapters, health)
    null.py       NullEngineService: streams fixed tokens (gateway overhead benchmarks)
    app.py        create_app(): FastAPI routes over a service (FastAPI is imported there only)
    serve.py      serve(): load the model in the background, run uvicorn; /health is ready after the load

Importing this package imports nothing heavy; the engine core never imports it.
"""
