// The longdoc REST API as the page uses it: JSON requests, server-sent event streams, errors.

const KEY = "longdoc.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export class ApiError extends Error {
  constructor(type, message, status) {
    super(message);
    this.type = type;
    this.status = status;
  }
}

// A Blob (a file) goes as the body itself, with its own type; anything else as JSON.
function headers(body) {
  const h = {};
  if (body instanceof Blob) h["content-type"] = body.type || "application/octet-stream";
  else if (body !== undefined) h["content-type"] = "application/json";
  if (apiKey()) h.authorization = `Bearer ${apiKey()}`;
  return h;
}

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON: a proxy's page, say
  }
  const error = body && body.error;
  if (error) return new ApiError(error.type, error.message, response.status);
  return new ApiError("http_error", `${response.status} ${response.statusText}`, response.status);
}

async function send(method, path, body, signal) {
  const response = await fetch(path, {
    method,
    headers: headers(body),
    body: body === undefined || body instanceof Blob ? body : JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  return response;
}

export async function call(method, path, body) {
  const response = await send(method, path, body);
  return response.status === 204 ? null : response.json();
}

export async function callText(path) {
  return (await send("GET", path)).text();
}

// One {event, data} per server-sent event. An `error` event is thrown as an ApiError, and so is a
// stream that ends before its `done` event. Leaving the loop early closes the request.
export async function* stream(path, body, signal) {
  const response = await send("POST", path, body, signal);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let carry = ""; // a "\r" at a chunk's end may be half of "\r\n"
  let done = false;
  try {
    for (;;) {
      const chunk = await reader.read();
      if (chunk.done) break;
      let raw = carry + chunk.value;
      carry = raw.endsWith("\r") ? "\r" : "";
      if (carry) raw = raw.slice(0, -1);
      buffer += raw.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = parseEvent(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
        if (!event) continue;
        if (event.event === "error") throw new ApiError(event.data.error.type, event.data.error.message, 200);
        done = event.event === "done";
        yield event;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
  if (!done) throw new ApiError("incomplete_stream", "the server closed the stream before it was done", 200);
}

function parseEvent(block) {
  let event = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return null;
  return { event, data: JSON.parse(data.join("\n")) };
}
