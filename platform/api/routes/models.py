"""``GET /v1/models`` and ``GET /v1/models/{model}`` (OpenAI-compatible): the base model and the caller's adapters,
each ready version as ``name:<n>``, each alias as ``name:<alias>``, and ``name`` itself (= ``name:latest``).
An unknown model, or another tenant's adapter, is OpenAI's 404 ``model_not_found``."""
from __future__ import annotations

from fastapi import APIRouter, Path, Request
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from loraplex.platform.api.routes.inference import ERRORS, gateway_of
from loraplex.platform.db.models import Adapter, AdapterAlias, AdapterStatus, AdapterVersion
from loraplex.platform.engines.limits import unservable_reason
from loraplex.platform.gateway.pipeline import authenticate
from loraplex.platform.gateway.state import Gateway
from loraplex.platform.inference.errors import model_not_found
from loraplex.platform.inference.model_name import MAX_MODEL_CHARS, ModelNameError, parse_model
from loraplex.platform.inference.protocol import ModelCard, ModelList, now_s

router = APIRouter(prefix="/v1", tags=["inference"])


def _adapter_cards(gw: Gateway, tenant_id: str, owner: str) -> list[ModelCard]:
    with gw.sessions() as session:
        versions = session.execute(
            select(Adapter.name, AdapterVersion.id, AdapterVersion.number, AdapterVersion.created_at,
                   AdapterVersion.rank, AdapterVersion.targets, AdapterVersion.dtype, AdapterVersion.size_bytes)
            .join(AdapterVersion, AdapterVersion.adapter_id == Adapter.id)
            .where(Adapter.tenant_id == tenant_id, AdapterVersion.status == AdapterStatus.ready)
            .order_by(Adapter.name, AdapterVersion.number)).all()
        aliases = session.execute(
            select(Adapter.name, AdapterAlias.name, AdapterAlias.version_id)
            .join(AdapterAlias, AdapterAlias.adapter_id == Adapter.id)
            .where(Adapter.tenant_id == tenant_id).order_by(Adapter.name, AdapterAlias.name)).all()
    limits = gw.serving_limits
    card_of: dict[str, dict] = {}
    for _, vid, _, ts, rank, targets, dtype, size in versions:
        reason = unservable_reason(limits, rank=rank, targets=targets or (), dtype=dtype, size_bytes=size)
        card_of[vid] = {"created": int(ts.timestamp()) if ts else now_s(), "owned_by": owner,
                        "servable": reason is None, "unservable_reason": reason}
    cards: list[ModelCard] = []
    for name, alias, vid in aliases:
        if vid not in card_of:
            continue
        if alias == "latest":
            cards.append(ModelCard(id=name, **card_of[vid]))
        cards.append(ModelCard(id=f"{name}:{alias}", **card_of[vid]))
    cards += [ModelCard(id=f"{name}:{number}", **card_of[vid]) for name, vid, number, *_ in versions]
    return sorted(cards, key=lambda c: c.id)


@router.get("/models", response_model=ModelList, response_model_exclude_none=True,
            summary="Models this key can use (OpenAI-compatible)")
async def list_models(request: Request) -> ModelList:
    gw = gateway_of(request)
    tenant = await authenticate(gw, request.headers.get("authorization"))
    base = ModelCard(id=gw.model_name, created=0, owned_by="loraplex")
    return ModelList(data=[base, *await run_in_threadpool(_adapter_cards, gw, tenant.id, tenant.name)])


@router.get("/models/{model:path}", response_model=ModelCard, response_model_exclude_none=True,
            summary="One model this key can use (OpenAI-compatible)", responses={k: ERRORS[k] for k in (401, 404)})
async def retrieve_model(request: Request, model: str = Path(max_length=MAX_MODEL_CHARS,
                                                             examples=["support-bot:prod"])) -> ModelCard:
    """OpenAI's ``models.retrieve``: the base model, or one of the caller's ready adapter references."""
    gw = gateway_of(request)
    tenant = await authenticate(gw, request.headers.get("authorization"))
    try:
        target = parse_model(model, base_names=gw.base_names)
    except ModelNameError:
        raise model_not_found(model) from None
    if target.base:
        return ModelCard(id=gw.model_name, created=0, owned_by="loraplex")
    cards = await run_in_threadpool(_adapter_cards, gw, tenant.id, tenant.name)
    wanted = model.strip()
    for card in cards:
        if card.id == wanted:
            return card
    raise model_not_found(model)
