// A document's text with the passages behind an answer marked, each mark reachable by its number.

// Spans [start, end) in document order, overlaps cut so that each character is marked once.
export function markSpans(passages, length) {
  const spans = passages
    .map((p, index) => ({ index, start: Math.max(0, p.char_start), end: Math.min(length, p.char_end) }))
    .filter((s) => s.end > s.start)
    .sort((a, b) => a.start - b.start || a.index - b.index);
  let reached = 0;
  const cut = [];
  for (const span of spans) {
    const start = Math.max(span.start, reached);
    if (span.end <= start) continue;
    cut.push({ ...span, start });
    reached = span.end;
  }
  return cut;
}

export function render(pre, text, passages) {
  const fragment = document.createDocumentFragment();
  let at = 0;
  for (const span of markSpans(passages, text.length)) {
    fragment.append(text.slice(at, span.start));
    const mark = document.createElement("mark");
    mark.id = `passage-${span.index + 1}`;
    mark.dataset.passage = String(span.index + 1);
    mark.tabIndex = -1;
    mark.textContent = text.slice(span.start, span.end);
    fragment.append(mark);
    at = span.end;
  }
  fragment.append(text.slice(at));
  pre.replaceChildren(fragment);
}

export function show(pre, passageNumber) {
  const mark = pre.querySelector(`#passage-${passageNumber}`);
  if (!mark) return false;
  for (const m of pre.querySelectorAll("mark.current")) m.classList.remove("current");
  mark.classList.add("current");
  mark.scrollIntoView({ block: "center" });
  mark.focus({ preventScroll: true });
  return true;
}
