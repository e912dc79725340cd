// A small markdown reader that builds DOM nodes: headings, paragraphs, lists, quotes, rules,
// fenced code blocks (with a copy button), inline code, bold, italics and links. Every piece of
// text becomes a text node, so markup in a reply (<script>, <img onerror=...>) shows as written.
// Links are kept only for http(s) and mailto addresses. A fence left open (a reply still
// streaming) runs to the end of the text.

import { append, copyText, el } from "./dom.js";

const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s{0,3}>\s?/;
const BULLET = /^(\s*)([-*+])\s+/;
const NUMBERED = /^(\s*)(\d{1,9})[.)]\s+/;
const INLINE = new RegExp([
  "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)",  // 1, 2: code span
  "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*",      // 3: bold
  "(?<![\\w])__(?=\\S)([\\s\\S]*?\\S)__(?![\\w])",  // 4: bold, not inside a word (snake_case, __init__)
  "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*",    // 5: italics
  "\\[([^\\]\\n]+)\\]\\(\\s*([^\\s)]+)\\s*\\)",  // 6, 7: link
  "(https?:\\/\\/[^\\s<>()\"']*[^\\s<>()\"'.,;:!?])",  // 8: bare address
].join("|"), "g");

export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  append(fragment, blocks(text.replace(/\r\n?/g, "\n").split("\n")));
  return fragment;
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (!line.trim()) {
      i++;
    } else if ((match = FENCE.exec(line))) {
      const fence = match[1];
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) body.push(lines[i]);
      i++;
      out.push(codeBlock(body.join("\n"), match[2]));
    } else if ((match = HEADING.exec(line))) {
      out.push(el(`h${Math.min(match[1].length + 2, 6)}`, {}, inline(match[2])));
      i++;
    } else if (RULE.test(line)) {
      out.push(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) body.push(lines[i].replace(QUOTE, ""));
      out.push(el("blockquote", {}, blocks(body)));
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const ordered = !BULLET.test(line);
      const pattern = ordered ? NUMBERED : BULLET;
      const list = el(ordered ? "ol" : "ul");
      if (ordered) list.start = Number(pattern.exec(line)[2]);
      while (i < lines.length && pattern.test(lines[i])) {
        const item = [lines[i].replace(pattern, "")];
        for (i++; i < lines.length && /^\s{2,}\S/.test(lines[i]) && !pattern.test(lines[i]); i++) {
          item.push(lines[i].trim());
        }
        list.append(el("li", {}, inline(item.join("\n"))));
      }
      out.push(list);
    } else {
      const body = [];
      for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) body.push(lines[i]);
      out.push(el("p", {}, inline(body.join("\n"))));
    }
  }
  return out;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || BULLET.test(line)
    || NUMBERED.test(line);
}

function codeBlock(code, language) {
  const copy = el("button", { type: "button", class: "copy-code", text: "Copy" });
  copy.addEventListener("click", async () => {
    await copyText(code);
    copy.textContent = "Copied";
  });
  return el("div", { class: "code-block" },
    el("div", { class: "code-head" }, el("span", { text: language || "code" }), copy),
    el("pre", {}, el("code", { text: code, dataset: { language: language || "" } })));
}

function inline(text) {
  const nodes = [];
  let last = 0;
  const pattern = new RegExp(INLINE);  // its own lastIndex: the calls below recurse
  for (let m; (m = pattern.exec(text));) {
    nodes.push(...lineBreaks(text.slice(last, m.index)));
    last = pattern.lastIndex;
    if (m[2] !== undefined) nodes.push(el("code", { text: m[2] }));
    else if (m[3] !== undefined || m[4] !== undefined) nodes.push(el("strong", {}, inline(m[3] ?? m[4])));
    else if (m[5] !== undefined) nodes.push(el("em", {}, inline(m[5])));
    else if (m[6] !== undefined) nodes.push(link(m[7], inline(m[6]), m[0]));
    else nodes.push(link(m[8], [m[8]], m[0]));
  }
  nodes.push(...lineBreaks(text.slice(last)));
  return nodes;
}

function lineBreaks(text) {
  const nodes = [];
  text.split("\n").forEach((part, index) => {
    if (index > 0) nodes.push(el("br"));
    if (part) nodes.push(document.createTextNode(part));
  });
  return nodes;
}

export function safeUrl(address) {
  try {
    const url = new URL(address, window.location.href);
    return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

function link(address, children, written) {
  const href = safeUrl(address);
  if (!href) return document.createTextNode(written);
  return el("a", { href, target: "_blank", rel: "noopener noreferrer nofollow" }, children);
}
