// The page: sessions, uploads with progress, streamed answers, and the passages behind them.

import { ApiError, apiKey, call, setApiKey, stream } from "./api.js";
import { dropTexts, loadText, saveText } from "./texts.js";
import { render, show } from "./viewer.js";

const $ = (id) => document.getElementById(id);
const state = { models: [], session: null, passages: [], viewing: null, asking: null };

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

async function refreshSessions(selectId = state.session?.id) {
  const sessions = (await call("GET", "/v1/sessions")).data.sort((a, b) => b.created_at - a.created_at);
  $("sessions").replaceChildren(...sessions.map(sessionItem));
  const selected = sessions.find((s) => s.id === selectId) || null;
  selectSession(selected);
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
  await call("DELETE", `/v1/sessions/${id}`);
  await dropTexts(id);
  if (state.session?.id === id) clearViewer();
  await refreshSessions(state.session?.id === id ? null : state.session?.id);
}

function selectSession(session) {
  state.session = session;
  for (const button of document.querySelectorAll("#sessions .pick")) {
    if (session && button.dataset.session === session.id) button.setAttribute("aria-current", "true");
    else button.removeAttribute("aria-current");
  }
  $("session-detail").hidden = !session;
  $("ask").disabled = !session || Boolean(state.asking);
  if (!session) return;
  $("session-name").textContent = `${session.id} (${session.model}, ${session.memory})`;
  $("documents").replaceChildren(...session.documents.map(documentItem));
  const c = session.cache;
  $("cache").textContent = `Cache: ${c.entries} entries, ${size(c.bytes)}` + (c.dropped_tokens ? `, ${c.dropped_tokens} tokens dropped` : "") + (session.resident ? "" : " (on disk)");
}

function documentItem(doc) {
  const view = element("button", { type: "button", textContent: `${doc.name} · ${doc.tokens} tokens`, onclick: guarded(() => viewDocument(doc.id, [])) });
  const item = element("li", {}, view);
  if (doc.warning) item.append(element("p", { className: "warning", textContent: doc.warning }));
  return item;
}

// ---- documents -------------------------------------------------------------------------------

async function ingest(file) {
  if (!file || !state.session) return;
  const sessionId = state.session.id;
  const text = await file.text();
  const bar = $("ingest-progress");
  bar.value = 0;
  bar.hidden = false;
  $("file").disabled = true;
  $("ingest-status").textContent = `Reading ${file.name}…`;
  try {
    const body = { text, name: file.name, stream: true };
    for await (const { event, data } of stream(`/v1/sessions/${sessionId}/documents`, body)) {
      if (event === "progress") {
        bar.value = data.tokens_total ? data.tokens_done / data.tokens_total : 0;
        $("ingest-status").textContent = `${file.name}: ${data.tokens_done} of ${data.tokens_total} tokens`;
      } else if (event === "done") {
        bar.value = 1;
        await saveText(sessionId, data.id, text);
        $("ingest-status").textContent = `${file.name}: ${data.tokens} tokens in ${data.seconds.toFixed(1)} s` + (data.warning ? ` (${data.warning})` : "");
        await refreshSessions(sessionId);
        await viewDocument(data.id, []);
      }
    }
  } finally {
    $("file").disabled = false;
    $("file").value = "";
  }
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

function documentName(id) {
  return state.session?.documents.find((d) => d.id === id)?.name || id;
}

function clearViewer() {
  state.viewing = null;
  $("viewer-name").textContent = "";
  $("viewer-note").replaceChildren();
  $("viewer").replaceChildren();
}

async function viewDocument(documentId, passages) {
  const sessionId = state.session.id;
  const text = await loadText(sessionId, documentId);
  state.viewing = documentId;
  $("viewer-name").textContent = documentName(documentId);
  if (text === undefined) {
    const attach = element("input", { type: "file", accept: ".txt,.md,text/plain" });
    attach.setAttribute("aria-label", "open this document's text");
    attach.addEventListener("change", guarded(async () => {
      await saveText(sessionId, documentId, await attach.files[0].text());
      await viewDocument(documentId, passages);
    }));
    $("viewer-note").replaceChildren("This browser does not hold this document's text (it was uploaded elsewhere). Open the same file to see it: ", attach);
    $("viewer").replaceChildren();
    return false;
  }
  $("viewer-note").replaceChildren();
  // passages keep their numbers; those of other documents are left unmarked
  render($("viewer"), text, passages.map((p) => (p.document_id === documentId ? p : { ...p, char_end: -1 })));
  return true;
}

async function openPassage(number) {
  const passage = state.passages[number - 1];
  if (state.viewing !== passage.document_id || !$("viewer").querySelector(`#passage-${number}`)) {
    if (!(await viewDocument(passage.document_id, state.passages))) return;
  }
  show($("viewer"), number);
}

async function showPassages(items) {
  state.passages = items;
  const texts = {};
  for (const id of new Set(items.map((p) => p.document_id))) texts[id] = await loadText(state.session.id, id);
  $("passages").replaceChildren(...items.map((p, i) => {
    const text = texts[p.document_id];
    const score = p.score == null ? "" : `, score ${p.score.toFixed(3)}`;
    const button = element("button", { type: "button", textContent: `${documentName(p.document_id)}, characters ${p.char_start}–${p.char_end}${score}`, onclick: guarded(() => openPassage(i + 1)) });
    const excerpt = text === undefined ? "" : text.slice(p.char_start, Math.min(p.char_end, p.char_start + 240));
    return element("li", {}, button, element("blockquote", { textContent: excerpt }));
  }));
  if (items.length) await openPassage(1);
}

// ---- asking ----------------------------------------------------------------------------------

async function ask() {
  if (!state.session || state.asking) return;
  const controller = new AbortController();
  state.asking = controller;
  $("ask").disabled = true;
  $("stop").disabled = false;
  $("answer").textContent = "";
  $("answer-status").textContent = "Thinking…";
  $("passages").replaceChildren();
  const body = { question: $("question").value, max_tokens: Number($("max-tokens").value) || undefined, stream: true };
  try {
    for await (const { event, data } of stream(`/v1/sessions/${state.session.id}/ask`, body, controller.signal)) {
      if (event === "retrieval") await showPassages(data.items);
      else if (event === "delta") {
        $("answer").append(data.text);
        $("answer-status").textContent = "Answering…";
      } else if (event === "done") {
        const t = data.timings;
        $("answer-status").textContent = `Done (${data.finish_reason}): ${data.usage.completion_tokens} tokens, first after ${t.ttft_seconds.toFixed(2)} s, ${t.total_seconds.toFixed(1)} s in all`;
      }
    }
  } catch (error) {
    if (error.name === "AbortError") $("answer-status").textContent = "Stopped.";
    else {
      $("answer-status").textContent = "Failed.";
      throw error;
    }
  } finally {
    state.asking = null;
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
  $("stop").addEventListener("click", () => state.asking?.abort());
  setUpDrop();
  guarded(async () => {
    await loadModels();
    await refreshSessions();
  })();
}

start();
