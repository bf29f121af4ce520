"""Sessions, their documents and their cache."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Response

from engine.errors import NotFoundError
from engine.interface import SessionInfo
from server.deps import EngineDep
from server.schemas import CachePublic, DocumentList, DocumentPublic, SessionCreate, SessionList, SessionPublic

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


def public(info: SessionInfo) -> SessionPublic:
    return SessionPublic.model_validate(asdict(info))


@router.post("", status_code=201)
async def create_session(body: SessionCreate, engine: EngineDep) -> SessionPublic:
    return public(engine.create_session(body.model, body.memory, body.options))


@router.get("")
async def list_sessions(engine: EngineDep) -> SessionList:
    return SessionList(data=[public(info) for info in engine.list_sessions()])


@router.get("/{session_id}")
async def get_session(session_id: str, engine: EngineDep) -> SessionPublic:
    return public(engine.get_session(session_id))


@router.delete("/{session_id}", status_code=204)
async def delete_session(session_id: str, engine: EngineDep) -> Response:
    engine.delete_session(session_id)
    return Response(status_code=204)


@router.get("/{session_id}/documents")
async def list_documents(session_id: str, engine: EngineDep) -> DocumentList:
    documents = engine.get_session(session_id).documents
    return DocumentList(data=[DocumentPublic.model_validate(asdict(d)) for d in documents])


@router.get("/{session_id}/documents/{document_id}")
async def get_document(session_id: str, document_id: str, engine: EngineDep) -> DocumentPublic:
    for document in engine.get_session(session_id).documents:
        if document.id == document_id:
            return DocumentPublic.model_validate(asdict(document))
    raise NotFoundError(f"session {session_id} has no document {document_id!r}")


@router.get("/{session_id}/cache")
async def get_cache(session_id: str, engine: EngineDep) -> CachePublic:
    return CachePublic.model_validate(asdict(engine.cache_info(session_id)))


@router.delete("/{session_id}/cache")
async def clear_cache(session_id: str, engine: EngineDep) -> CachePublic:
    return CachePublic.model_validate(asdict(await engine.clear_cache(session_id)))
