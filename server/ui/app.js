// The page: sessions, uploads with progress, streamed answers, and the passages behind them.

import { ApiError, apiKey, call, callText, setApiKey, stream } from "./api.js";
import { dropTexts, loadText, pruneTexts, saveText } from "./texts.js";
import { render, show, utf16Offsets } from "./viewer.js";

const $ = (id) => document.getElementById(id);
// session: the selected one; passages: the last answer's, for `answeredIn`; shown: what the
// viewer holds ({documentId, passages}); asking/uploading: the work in flight
const state = { models: [], session: null, passages: [], answeredIn: null, shown: null, asking: null, uploading: null };

function element(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

function size(bytes) {
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) {
    bytes /= 1024;
    i += 1;
  }
  return `${bytes.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function showError(error) {
  if (error.name === "AbortError") return;
  const box = $("error");
  const text = error instanceof ApiError ? `${error.type}: ${error.message}` : String(error.message || error);
  box.replaceChildren(element("span", { textContent: text }), element("button", { type: "button", textContent: "Dismiss", onclick: () => (box.hidden = true) }));
  box.hidden = false;
  if (error.status === 401) $("api-key").focus();
}

// Runs an action of the page; whatever it throws is shown, never lost in the console.
function guarded(action) {
  return async (event) => {
    event?.preventDefault?.();
    $("error").hidden = true;
    try {
      await action(event);
    } catch (error) {
      showError(error);
      if (error.type === "not_found") await refreshSessions().catch(() => {}); // it is gone: show what is left
    }
  };
}

// ---- models and sessions ---------------------------------------------------------------------

async function loadModels() {
  state.models = (await call("GET", "/v1/models")).data;
  $("model").replaceChildren(...state.models.map((m) => element("option", { value: m.id, textContent: m.id })));
  fillMemories();
}

function fillMemories() {
  const model = state.models.find((m) => m.id === $("model").value);
  const memories = model ? model.memories : [];
  $("memory").replaceChildren(
    element("option", { value: "", textContent: "the model's default" }),
    ...memories.map((m) => element("option", { value: m, textContent: m })),
  );
}

async function createSession() {
  const body = { model: $("model").value || null, memory: $("memory").value || null };
  const session = await call("POST", "/v1/sessions", body);
  await refreshSessions(session.id);
}

// Lists the sessions again and keeps the selection, read after the wait so that a session picked
// meanwhile stays picked; `selectId` picks another (null: none).
async function refreshSessions(selectId = undefined) {
  const sessions = (await call("GET", "/v1/sessions")).data.sort((a, b) => b.created_at - a.created_at);
  await pruneTexts(new Set(sessions.map((s) => s.id))).catch(() => {});
  const wanted = selectId === undefined ? state.session?.id : selectId;
  $("sessions").replaceChildren(...sessions.map(sessionItem));
  selectSession(sessions.find((s) => s.id === wanted) || null);
}

function sessionItem(session) {
  const label = `${session.id} · ${session.memory} · ${session.documents.length} doc · ${size(session.cache.bytes)}`;
  const pick = element("button", { type: "button", className: "pick", textContent: label, onclick: () => selectSession(session) });
  pick.dataset.session = session.id;
  const remove = element("button", { type: "button", textContent: "Delete", onclick: guarded(() => deleteSession(session.id)) });
  remove.setAttribute("aria-label", `Delete session ${session.id}`);
  return element("li", {}, pick, remove);
}

async function deleteSession(id) {
  if (state.asking?.sessionId === id) state.asking.controller.abort();
  await call("DELETE", `/v1/sessions/${id}`);
  await dropTexts(id);
  await refreshSessions(state.session?.id === id ? null : undefined);
  $("new-session").querySelector("button").focus(); // the focused Delete button is gone
}

function selectSession(session) {
  const changed = session?.id !== state.session?.id;
  state.session = session;
  for (const button of document.querySelectorAll("#sessions .pick")) {
    if (session && button.dataset.session === session.id) button.setAttribute("aria-current", "true");
    else button.removeAttribute("aria-current");
  }
  $("session-detail").hidden = !session;
  $("ask").disabled = !session || Boolean(state.asking);
  if (changed) clearAnswer();
  if (!session) return;
  $("session-name").textContent = `${session.id} (${session.model}, ${session.memory})`;
  $("documents").replaceChildren(...session.documents.map(documentItem));
  const c = session.cache;
  $("cache").textContent = `Cache: ${c.entries} entries, ${size(c.bytes)}` + (c.dropped_tokens ? `, ${c.dropped_tokens} tokens dropped` : "") + (session.resident ? "" : " (on disk)");
}

function documentItem(doc) {
  const view = element("button", { type: "button", textContent: `${doc.name} · ${doc.tokens} tokens`, onclick: guarded(() => viewDocument(state.session.id, doc.id, [])) });
  const item = element("li", {}, view);
  if (doc.warning) item.append(element("p", { className: "warning", textContent: doc.warning }));
  return item;
}

// ---- documents -------------------------------------------------------------------------------

async function ingest(file) {
  if (!file) return;
  if (!state.session) throw new ApiError("no_session", "make or pick a session first");
  if (state.uploading) throw new ApiError("busy", `${state.uploading} is still being read; wait for it`);
  const sessionId = state.session.id;
  state.uploading = file.name;
  $("file").disabled = true;
  const bar = $("ingest-progress");
  bar.value = 0;
  bar.hidden = false;
  $("ingest-status").textContent = `Reading ${file.name}…`;
  try {
    // plain text goes as JSON and is kept as read; any other file goes as it is, and its text as
    // the server extracted it is fetched afterwards (passages point into that text)
    const plain = isPlainText(file);
    const text = plain ? await file.text() : undefined;
    const url = `/v1/sessions/${sessionId}/documents` + (plain ? "" : `?stream=true&name=${encodeURIComponent(file.name)}`);
    const body = plain ? { text, name: file.name, stream: true } : file;
    for await (const { event, data } of stream(url, body)) {
      if (event === "progress") {
        bar.value = data.tokens_total ? data.tokens_done / data.tokens_total : 0;
        $("ingest-status").textContent = `${file.name}: ${data.tokens_done} of ${data.tokens_total} tokens`;
      } else if (event === "done") {
        bar.value = 1;
        await saveText(sessionId, data.id, plain ? text : await extractedText(sessionId, data.id));
        $("ingest-status").textContent = `${file.name}: ${data.tokens} tokens in ${data.seconds.toFixed(1)} s` + (data.warning ? ` (${data.warning})` : "");
        await refreshSessions();
        if (state.session?.id === sessionId) await viewDocument(sessionId, data.id, []);
      }
    }
  } finally {
    state.uploading = null;
    $("file").disabled = false;
    $("file").value = "";
  }
}

function isPlainText(file) {
  return file.type === "text/plain" || /\.te?xt$/i.test(file.name);
}

// The text the server made of a file; undefined when its memory does not keep texts.
async function extractedText(sessionId, documentId) {
  try {
    return await callText(`/v1/sessions/${sessionId}/documents/${documentId}/text`);
  } catch (error) {
    if (error.status === 404) return undefined;
    throw error;
  }
}

// "p. 12 · Chapter 3": where a passage sits, when its document has pages or sections.
function placeOf(p) {
  const pages = p.page_start == null ? "" : p.page_end > p.page_start ? `pp. ${p.page_start}–${p.page_end}` : `p. ${p.page_start}`;
  return [pages, p.section || ""].filter(Boolean).join(" · ");
}

function setUpDrop() {
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => {
    e.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", guarded((e) => {
    drop.classList.remove("over");
    return ingest(e.dataTransfer.files[0]);
  }));
  $("file").addEventListener("change", guarded(() => ingest($("file").files[0])));
}

// ---- the viewer ------------------------------------------------------------------------------

function documentOf(sessionId, documentId) {
  return state.session?.id === sessionId ? state.session.documents.find((d) => d.id === documentId) : undefined;
}

function clearViewer() {
  state.shown = null;
  $("viewer-name").textContent = "";
  $("viewer-note").replaceChildren();
  $("viewer").replaceChildren();
}

function clearAnswer() {
  state.passages = [];
  state.answeredIn = null;
  $("answer").textContent = "";
  $("answer-status").textContent = "";
  $("passages").replaceChildren();
  $("strategy").textContent = "";
  clearViewer();
}

// Shows a document with `passages` marked (those of other documents are left out, numbers kept).
async function viewDocument(sessionId, documentId, passages) {
  const text = await loadText(sessionId, documentId);
  const doc = documentOf(sessionId, documentId);
  state.shown = { documentId, passages };
  $("viewer-name").textContent = doc?.name || documentId;
  if (text === undefined) {
    $("viewer-note").replaceChildren("This browser does not hold this document's text (it was uploaded elsewhere). Open the same file to see it: ", attachInput(sessionId, documentId, passages));
    $("viewer").replaceChildren();
    return false;
  }
  $("viewer-note").replaceChildren();
  const pages = doc?.page_count ? await pageStarts(sessionId, documentId) : [];
  render($("viewer"), text, passages.map((p) => (p.document_id === documentId ? p : { ...p, char_end: -1 })), pages);
  return true;
}

const pagesCache = new Map();

async function pageStarts(sessionId, documentId) {
  const key = `${sessionId}/${documentId}`;
  if (!pagesCache.has(key)) pagesCache.set(key, (await call("GET", `/v1/sessions/${sessionId}/documents/${documentId}`)).pages);
  return pagesCache.get(key);
}

function attachInput(sessionId, documentId, passages) {
  const attach = element("input", { type: "file", accept: ".txt,.md,text/plain" });
  attach.setAttribute("aria-label", "open this document's text");
  attach.addEventListener("change", guarded(async () => {
    const text = await attach.files[0].text();
    const expected = documentOf(sessionId, documentId)?.chars;
    const chars = [...text].length;
    if (expected !== undefined && chars !== expected) {
      throw new ApiError("wrong_file", `that file has ${chars} characters; the document has ${expected}`);
    }
    await saveText(sessionId, documentId, text);
    await viewDocument(sessionId, documentId, passages);
  }));
  return attach;
}

async function openPassage(number, focus) {
  const passage = state.passages[number - 1];
  const sessionId = state.answeredIn;
  if (state.shown?.documentId !== passage.document_id || state.shown.passages !== state.passages) {
    if (!(await viewDocument(sessionId, passage.document_id, state.passages))) return;
  }
  show($("viewer"), number, focus);
}

async function showPassages(sessionId, items) {
  state.passages = items;
  state.answeredIn = sessionId;
  const texts = {};
  for (const id of new Set(items.map((p) => p.document_id))) {
    const text = await loadText(sessionId, id);
    if (text !== undefined) texts[id] = { text, at: utf16Offsets(text) };
  }
  $("passages").replaceChildren(...items.map((p, i) => {
    const score = p.score == null ? "" : `, score ${p.score.toFixed(3)}`;
    const name = p.document_name || documentOf(sessionId, p.document_id)?.name || p.document_id;
    const place = placeOf(p);
    const what = p.gathered === "summary" ? "summary of characters" : "characters";
    const label = `${name}${place ? ` (${place})` : ""}, ${what} ${p.char_start}–${p.char_end}${score}`;
    const button = element("button", { type: "button", textContent: label, onclick: guarded(() => openPassage(i + 1, true)) });
    const doc = texts[p.document_id];
    // a summary's own words; a passage's first characters from its document
    const excerpt = p.text ?? (doc ? doc.text.slice(doc.at(p.char_start), doc.at(Math.min(p.char_end, p.char_start + 240))) : "");
    return element("li", {}, button, element("blockquote", { textContent: excerpt }));
  }));
  if (items.length) await openPassage(1, false);
  else if (state.shown) await viewDocument(sessionId, state.shown.documentId, []); // no marks left from an earlier answer
}

// ---- asking ----------------------------------------------------------------------------------

async function ask() {
  if (!state.session) throw new ApiError("no_session", "make or pick a session first");
  if (state.asking) return;
  const sessionId = state.session.id;
  const controller = new AbortController();
  state.asking = { sessionId, controller };
  $("ask").disabled = true;
  $("stop").disabled = false;
  clearAnswer();
  $("answer").setAttribute("aria-busy", "true");
  $("answer-status").textContent = "Thinking…";
  const body = { question: $("question").value, max_tokens: Number($("max-tokens").value) || undefined, stream: true };
  try {
    for await (const { event, data } of stream(`/v1/sessions/${sessionId}/ask`, body, controller.signal)) {
      if (event === "retrieval") {
        $("strategy").textContent = data.strategy ? `(chosen by: ${data.strategy})` : "";
        await showPassages(sessionId, data.items);
      }
      else if (event === "delta") {
        $("answer").append(data.text);
        $("answer-status").textContent = "Answering…";
      } else if (event === "done") {
        const t = data.timings;
        $("answer-status").textContent = `Done (${data.finish_reason}): ${data.usage.completion_tokens} tokens, first after ${t.ttft_seconds.toFixed(2)} s, ${t.total_seconds.toFixed(1)} s in all`;
      }
    }
  } catch (error) {
    $("answer-status").textContent = error.name === "AbortError" ? "Stopped." : "Failed.";
    throw error;
  } finally {
    controller.abort(); // whatever ended the loop, the request ends with it
    state.asking = null;
    $("answer").removeAttribute("aria-busy");
    $("stop").disabled = true;
    $("ask").disabled = !state.session;
  }
}

// ---- start -----------------------------------------------------------------------------------

function start() {
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", guarded(async () => {
    setApiKey($("api-key").value.trim());
    await loadModels();
    await refreshSessions();
  }));
  $("model").addEventListener("change", fillMemories);
  $("new-session").addEventListener("submit", guarded(createSession));
  $("ask-form").addEventListener("submit", guarded(ask));
  $("question").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("ask-form").requestSubmit();
  });
  $("stop").addEventListener("click", () => state.asking?.controller.abort());
  setUpDrop();
  guarded(async () => {
    await loadModels();
    await refreshSessions();
  })();
}

start();
