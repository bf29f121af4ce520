"""Sessions, their documents and their cache."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse

from engine.errors import NotFoundError
from engine.interface import SessionInfo
from server.deps import CallerDep, EngineDep, visible_session
from server.schemas import (
    CachePublic,
    DocumentDetail,
    DocumentList,
    DocumentPublic,
    SectionPublic,
    SessionCreate,
    SessionList,
    SessionPublic,
)

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


def public(info: SessionInfo) -> SessionPublic:
    return SessionPublic.model_validate(asdict(info))


@router.post("", status_code=201)
async def create_session(body: SessionCreate, engine: EngineDep, caller: CallerDep) -> SessionPublic:
    return public(engine.create_session(body.model, body.memory, body.options, caller.name if caller else None))


@router.get("")
async def list_sessions(engine: EngineDep, caller: CallerDep) -> SessionList:
    """The caller's sessions (every session for the admin key, or when no keys are configured)."""
    infos = engine.list_sessions()
    return SessionList(data=[public(info) for info in infos if caller is None or caller.may_see(info.owner)])


@router.get("/{session_id}")
async def get_session(session_id: str, engine: EngineDep, caller: CallerDep) -> SessionPublic:
    return public(visible_session(engine, session_id, caller))


@router.delete("/{session_id}", status_code=204)
async def delete_session(session_id: str, engine: EngineDep, caller: CallerDep) -> Response:
    visible_session(engine, session_id, caller)
    engine.delete_session(session_id)
    return Response(status_code=204)


@router.get("/{session_id}/documents")
async def list_documents(session_id: str, engine: EngineDep, caller: CallerDep) -> DocumentList:
    documents = visible_session(engine, session_id, caller).documents
    return DocumentList(data=[DocumentPublic.model_validate(asdict(d)) for d in documents])


@router.get("/{session_id}/documents/{document_id}")
async def get_document(session_id: str, document_id: str, engine: EngineDep, caller: CallerDep) -> DocumentDetail:
    """One document with its outline (headings, each with its page) and where its pages start."""
    for document in visible_session(engine, session_id, caller).documents:
        if document.id == document_id:
            layout = document.layout
            outline = [
                SectionPublic(
                    title=s.title, level=s.level, char_start=s.start, page=(layout.page_range(s.start, s.start + 1) or (None,))[0]
                )
                for s in layout.sections
            ]
            return DocumentDetail.model_validate(asdict(document) | {"outline": outline, "pages": list(layout.pages)})
    raise NotFoundError(f"session {session_id} has no document {document_id!r}")


@router.get("/{session_id}/documents/{document_id}/text", response_class=PlainTextResponse)
async def get_document_text(session_id: str, document_id: str, engine: EngineDep, caller: CallerDep) -> PlainTextResponse:
    """The text the document was ingested as (a PDF's, EPUB's or web page's extracted text), which
    passages' character offsets point into; sessions whose memory keeps it (text) only."""
    visible_session(engine, session_id, caller)
    return PlainTextResponse(await engine.document_text(session_id, document_id))


@router.get("/{session_id}/cache")
async def get_cache(session_id: str, engine: EngineDep, caller: CallerDep) -> CachePublic:
    return CachePublic.model_validate(asdict(visible_session(engine, session_id, caller).cache))


@router.delete("/{session_id}/cache")
async def clear_cache(session_id: str, engine: EngineDep, caller: CallerDep) -> CachePublic:
    visible_session(engine, session_id, caller)
    return CachePublic.model_validate(asdict(await engine.clear_cache(session_id)))
