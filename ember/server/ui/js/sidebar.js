// The list of conversations: open, rename, export and delete (asked twice), newest first.

import { clear, el } from "./dom.js";

export class Sidebar {
  // actions: { open(c), rename(c, title), remove(c), exportOne(c) }
  constructor(list, store, actions) {
    this.list = list;
    this.store = store;
    this.actions = actions;
  }

  render() {
    clear(this.list);
    for (const conversation of this.store.sorted) this.list.append(this.item(conversation));
  }

  item(conversation) {
    const current = conversation.id === this.store.currentId;
    const title = el("button", { type: "button", class: "title", text: conversation.title, title: conversation.title,
      on: { click: () => this.actions.open(conversation) } });
    if (current) title.setAttribute("aria-current", "true");
    const tools = el("span", { class: "item-tools" },
      this.tool("Rename", "\u270e", () => this.startRename(item, conversation)),
      this.tool("Export as JSON", "\u2913", () => this.actions.exportOne(conversation)),
      this.tool("Delete", "\u2715", () => this.confirmDelete(item, conversation)));
    const item = el("li", { class: current ? "current" : "", dataset: { id: conversation.id } }, title, tools);
    return item;
  }

  tool(label, symbol, handler) {
    return el("button", { type: "button", class: "tool", title: label, "aria-label": label, text: symbol,
      on: { click: handler } });
  }

  startRename(item, conversation) {
    const input = el("input", { class: "rename", value: conversation.title, "aria-label": "New title" });
    let finished = false;  // Enter or Escape, then the blur that removing the input causes
    const finish = (keep) => {
      if (finished) return;
      finished = true;
      if (keep) this.actions.rename(conversation, input.value);
      this.render();
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") finish(true);
      else if (event.key === "Escape") {
        event.stopPropagation();
        finish(false);
      }
    });
    input.addEventListener("blur", () => finish(true));
    item.replaceChildren(input);
    input.select();
  }

  confirmDelete(item, conversation) {
    item.replaceChildren(el("span", { class: "confirm", text: `Delete \u201c${conversation.title}\u201d?` }),
      el("span", { class: "item-tools" },
        el("button", { type: "button", class: "danger", text: "Delete", on: { click: () => this.actions.remove(conversation) } }),
        el("button", { type: "button", text: "Keep", on: { click: () => this.render() } })));
  }
}
