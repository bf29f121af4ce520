// A document's text with the passages behind an answer marked, each mark reachable by number.

// The server counts characters in code points (Python); JavaScript strings index UTF-16 units.
// Returns a function from a code-point offset to a UTF-16 offset (the identity without astral characters).
export function utf16Offsets(text) {
  if (!/[\uD800-\uDBFF]/.test(text)) return (offset) => offset;
  const units = [];
  let at = 0;
  for (const char of text) {
    units.push(at);
    at += char.length;
  }
  units.push(at);
  return (offset) => units[Math.max(0, Math.min(offset, units.length - 1))];
}

// Spans [start, end) (UTF-16) in document order, overlaps cut so that each character is marked
// once; `numbers` lists the passages (from 1) each span shows, a passage inside another included.
export function markSpans(passages, text) {
  const at = utf16Offsets(text);
  const spans = passages
    .map((p, index) => ({ number: index + 1, start: at(p.char_start), end: at(p.char_end) }))
    .filter((s) => s.end > s.start)
    .sort((a, b) => a.start - b.start || a.number - b.number);
  const cut = [];
  for (const span of spans) {
    const last = cut[cut.length - 1];
    if (last && span.end <= last.end) {
      last.numbers.push(span.number); // wholly inside the previous mark: shown by it
      continue;
    }
    cut.push({ start: last ? Math.max(span.start, last.end) : span.start, end: span.end, numbers: [span.number] });
  }
  return cut;
}

// A page's start, drawn by CSS from data-page so that the text (and a copy of it) stays the document's.
function pageMark(page) {
  const mark = document.createElement("span");
  mark.className = "page-mark";
  mark.dataset.page = String(page);
  mark.setAttribute("role", "separator");
  mark.setAttribute("aria-label", `page ${page}`);
  return mark;
}

// The text into `pre`, the passages marked and, before the character where each page starts
// (`pages`, code-point offsets), that page's mark.
export function render(pre, text, passages, pages = []) {
  const at = utf16Offsets(text);
  const breaks = pages.map((start) => at(start));
  const fragment = document.createDocumentFragment();
  let next = 0; // the first page whose mark is not placed yet
  const put = (from, to, numbers) => {
    for (;;) {
      while (next < breaks.length && breaks[next] <= from) fragment.append(pageMark(++next));
      if (from >= to) return;
      const end = next < breaks.length ? Math.min(to, breaks[next]) : to;
      if (numbers) {
        const mark = document.createElement("mark");
        mark.dataset.passages = numbers.join(" ");
        mark.tabIndex = -1;
        mark.textContent = text.slice(from, end);
        fragment.append(mark);
      } else {
        fragment.append(text.slice(from, end));
      }
      from = end;
    }
  };
  let cursor = 0;
  for (const span of markSpans(passages, text)) {
    put(cursor, span.start, null);
    put(span.start, span.end, span.numbers);
    cursor = span.end;
  }
  put(cursor, text.length, null);
  while (next < breaks.length) fragment.append(pageMark(++next));
  pre.replaceChildren(fragment);
}

// Brings passage `number`'s mark into view; moves the focus there only when the user asked.
export function show(pre, number, focus) {
  const mark = pre.querySelector(`mark[data-passages~="${number}"]`);
  if (!mark) return false;
  for (const m of pre.querySelectorAll("mark.current")) m.classList.remove("current");
  mark.classList.add("current");
  mark.scrollIntoView({ block: "center" });
  if (focus) mark.focus({ preventScroll: true });
  return true;
}
