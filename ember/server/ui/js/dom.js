// Building DOM nodes. Text always goes in as text nodes (never parsed as HTML): this is the
// only way the page turns strings into elements.

export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key === "on") for (const [event, handler] of Object.entries(value)) node.addEventListener(event, handler);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key in node && typeof node[key] !== "function") node[key] = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, children);
  return node;
}

export function append(node, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function clear(node) {
  while (node.firstChild) node.firstChild.remove();
  return node;
}

export function newId() {
  // crypto.randomUUID exists only on https and localhost pages; this page may be served on a LAN address.
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = el("textarea", { value: text, readOnly: true, class: "offscreen" });
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}
