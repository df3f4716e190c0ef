"""All routers of the API."""
from fastapi import APIRouter

from loraplex.platform.api.routes import adapters, health, keys, tenants

api_router = APIRouter()
for module in (health, tenants, keys, adapters):
    api_router.include_router(module.router)
