// The texts of the documents this browser uploaded, kept in IndexedDB: the server keeps a
// document's memory, not always its text, and the passages are shown in the text.

const DB = "longdoc";
const STORE = "texts";

function open() {
  return new Promise((resolve, reject) => {
    const request = indexedDB.open(DB, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE);
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}

async function run(mode, action) {
  const db = await open();
  try {
    return await new Promise((resolve, reject) => {
      const request = action(db.transaction(STORE, mode).objectStore(STORE));
      request.onsuccess = () => resolve(request.result);
      request.onerror = () => reject(request.error);
    });
  } finally {
    db.close();
  }
}

const key = (sessionId, documentId) => `${sessionId}/${documentId}`;

export function saveText(sessionId, documentId, text) {
  return run("readwrite", (store) => store.put(text, key(sessionId, documentId)));
}

export function loadText(sessionId, documentId) {
  return run("readonly", (store) => store.get(key(sessionId, documentId)));
}

export function dropTexts(sessionId) {
  const range = IDBKeyRange.bound(`${sessionId}/`, `${sessionId}/\uffff`);
  return run("readwrite", (store) => store.delete(range));
}

// Forgets the texts of sessions the server no longer lists (deleted, or expired elsewhere).
export function pruneTexts(liveSessionIds) {
  return run("readwrite", (store) => {
    const keys = store.getAllKeys();
    keys.addEventListener("success", () => {
      for (const key of keys.result) if (!liveSessionIds.has(String(key).split("/")[0])) store.delete(key);
    });
    return keys;
  });
}
