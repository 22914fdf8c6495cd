"""OpenAI's Conversations API on chatkv's sessions: `POST /v1/conversations`, `GET`, `POST`
(metadata) and `DELETE /v1/conversations/{id}`, `GET` and `POST /v1/conversations/{id}/items`,
`GET` and `DELETE /v1/conversations/{id}/items/{item_id}`.

A conversation is a session with a durable id (`sessions.conversations`): its items are kept as
given (text messages only; other item types and content parts are refused with 400
`unsupported_parameter`), and a response created with `conversation` runs its turn after them on
the conversation's session and appends its input and its output (`app.http.responses_api`).
Items added or deleted here put the items out of step with the session: the next response then
starts a new session holding them (prefilled). For a response, the items must read as a
conversation: leading system or developer messages, then user and assistant messages alternating
(a 400 otherwise, and nothing changes). A conversation holds at most 10,000 items and 16 MiB of
them (`sessions.conversations`): items past either are refused with 400 `conversation_too_large`,
and nothing is added.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from app.http.api_auth import bearer_scheme, tenant_of
from app.http.api_errors import ApiError
from app.http.responses_items import InputItem, check_metadata, descending, dumps, page_body, stored_items
from sessions import ConversationRecord, ConversationRecords, InvalidInput, Tenant

TenantDep = Annotated[Tenant, Depends(tenant_of)]
MAX_ITEMS_PER_REQUEST = 20
"""OpenAI's limit of items one request adds."""


class ConversationCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    items: list[InputItem] | None = Field(default=None, description="Up to 20 initial message items.")
    metadata: dict[str, str] | None = Field(default=None, description="Up to 16 string pairs.")


class ConversationUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    metadata: dict[str, str] = Field(description="Replaces the conversation's metadata.")


class ItemsCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    items: list[InputItem] = Field(description="Up to 20 message items to append.")


def conversations_router(conversations: ConversationRecords, route_class: type[APIRoute]) -> APIRouter:
    """The `/conversations` routes, to be mounted under `/v1` (see the module docstring)."""
    router = APIRouter(route_class=route_class, dependencies=[Depends(bearer_scheme)], tags=["Conversations"])
    missing: dict[int | str, dict[str, Any]] = {404: {"description": "No such conversation (or item)."}}
    full: dict[int | str, dict[str, Any]] = {
        **missing,
        400: {"description": "Invalid items, or the conversation would pass its caps (`conversation_too_large`)."},
    }

    @router.post("/conversations", responses=full)
    def create_conversation(body: ConversationCreate, tenant: TenantDep) -> JSONResponse:
        """Create a conversation with initial items and metadata."""
        items = _new_items(body.items or [])
        metadata = check_metadata(body.metadata)
        record = conversations.create(tenant.id, metadata=dumps(metadata), items=items)
        return JSONResponse(_conversation(record))

    @router.get("/conversations/{conversation_id}", responses=missing)
    def retrieve_conversation(conversation_id: str, tenant: TenantDep) -> JSONResponse:
        return JSONResponse(_conversation(conversations.get(tenant.id, conversation_id)))

    @router.post("/conversations/{conversation_id}", responses=missing)
    def update_conversation(conversation_id: str, body: ConversationUpdate, tenant: TenantDep) -> JSONResponse:
        """Replace the conversation's metadata."""
        metadata = dumps(check_metadata(body.metadata))
        return JSONResponse(_conversation(conversations.update(tenant.id, conversation_id, metadata=metadata)))

    @router.delete("/conversations/{conversation_id}", responses=missing)
    def delete_conversation(conversation_id: str, tenant: TenantDep) -> JSONResponse:
        """Delete the conversation, and its session unless a stored response points into it."""
        conversations.delete(tenant.id, conversation_id)
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    @router.get("/conversations/{conversation_id}/items", responses=missing)
    def list_items(
        conversation_id: str,
        tenant: TenantDep,
        after: Annotated[str | None, Query(description="List the items after this item id.")] = None,
        limit: Annotated[int, Query(description="Items per page, 1-100.")] = 20,
        order: Annotated[str, Query(description="`desc` (newest first, the default) or `asc`.")] = "desc",
    ) -> JSONResponse:
        newest_first = descending(limit, order)
        page, more = conversations.page(tenant.id, conversation_id, after=after, limit=limit, descending=newest_first)
        return JSONResponse(page_body(page, more))

    @router.post("/conversations/{conversation_id}/items", responses=full)
    def create_items(conversation_id: str, body: ItemsCreate, tenant: TenantDep) -> JSONResponse:
        """Append items; answers the items added."""
        added = _new_items(body.items)
        conversations.append(tenant.id, conversation_id, added)
        return JSONResponse(page_body(added, False))

    @router.get("/conversations/{conversation_id}/items/{item_id}", responses=missing)
    def retrieve_item(conversation_id: str, item_id: str, tenant: TenantDep) -> JSONResponse:
        item = conversations.item(tenant.id, conversation_id, item_id)
        if item is None:
            raise _item_not_found(item_id)
        return JSONResponse(item)

    @router.delete("/conversations/{conversation_id}/items/{item_id}", responses=missing)
    def delete_item(conversation_id: str, item_id: str, tenant: TenantDep) -> JSONResponse:
        """Delete an item; answers the conversation."""
        record = conversations.delete_item(tenant.id, conversation_id, item_id)
        if record is None:
            raise _item_not_found(item_id)
        return JSONResponse(_conversation(record))

    return router


def _new_items(items: list[InputItem]) -> list[dict[str, Any]]:
    if len(items) > MAX_ITEMS_PER_REQUEST:
        raise InvalidInput(f"at most {MAX_ITEMS_PER_REQUEST} items per request, got {len(items)}")
    return stored_items(items, "items")


def _item_not_found(item_id: str) -> ApiError:
    return ApiError(404, f"item not found: {item_id}", "item_not_found", param="item_id")


def _conversation(record: ConversationRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "conversation",
        "created_at": int(record.created_at.timestamp()),
        "metadata": json.loads(record.metadata),
    }
