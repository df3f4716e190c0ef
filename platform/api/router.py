"""All routers of the API."""
from fastapi import APIRouter

from loraplex.platform.api.routes import adapters, health, inference, keys, models, tenants, usage

api_router = APIRouter()
for module in (health, tenants, keys, adapters, inference, models, usage):
    api_router.include_router(module.router)
