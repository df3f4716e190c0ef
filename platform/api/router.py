"""All routers of the API."""
from fastapi import APIRouter

from loraplex.platform.api.routes import adapters, health, imports, inference, keys, models, tenants, usage

api_router = APIRouter()
for module in (health, tenants, keys, imports, adapters, inference, models, usage):
    api_router.include_router(module.router)
api_router.include_router(keys.tenant_router)
