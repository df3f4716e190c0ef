"""The inference gateway's runtime: engine replicas behind the router, quotas, tokenizer, adapter references,
residency polling, eviction fan-out and usage metering, owned by one ``Gateway`` that the app starts and stops.

    gateway = Gateway.build(settings, sessionmaker, blob_store)   # in the app's lifespan
    await gateway.start(); ...; await gateway.stop()               # stop flushes usage and closes engines
"""
from loraplex.platform.gateway.state import Gateway

__all__ = ["Gateway"]
