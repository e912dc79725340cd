// One message on screen: its images above its text (markdown), folded reasoning with its length,
// tool calls as cards, the reply's figures from ember's timings, its state, and copy / edit /
// regenerate.

import { clear, copyText, el } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

const STATE_NOTES = {
  stopped: "Stopped.",
  length: "Cut at the token limit.",
};

export class MessageView {
  // modelName: a reply's author where the message has no `model` (one stored by an older page);
  // actions: { edit(message, text, resend), regenerate(message), busy() }; imageUrl(id):
  // an attached image's data URL, null when it was not kept, undefined while it is being read.
  constructor(message, { modelName, actions, imageUrl }) {
    this.message = message;
    this.actions = actions;
    this.imageUrl = imageUrl;
    this.editing = false;
    this.reasoning = el("details", { class: "reasoning" }, el("summary"), el("div", { class: "reasoning-body" }));
    this.images = el("div", { class: "images" });
    this.content = el("div", { class: "content" });
    this.tools = el("div", { class: "tool-calls" });
    this.figures = el("div", { class: "figures" });
    this.note = el("div", { class: "note" });
    this.buttons = el("div", { class: "actions" });
    const who = message.role === "user" ? "You" : message.model || modelName || "assistant";
    this.node = el("article", { class: `message ${message.role}`, dataset: { id: message.id, role: message.role } },
      el("div", { class: "who", text: who }), this.reasoning, this.images, this.content, this.tools, this.note, this.figures,
      this.buttons);
    this.update();
  }

  update() {
    const m = this.message;
    this.node.dataset.state = m.state ?? "done";
    this.updateReasoning();
    this.updateImages();
    if (!this.editing) clear(this.content).append(renderMarkdown(m.content ?? ""));
    clear(this.tools).append(...(m.tool_calls ?? []).map(toolCard));
    this.updateNote();
    this.figures.textContent = figures(m);
    this.updateButtons();
  }

  updateReasoning() {
    const text = this.message.reasoning ?? "";
    this.reasoning.hidden = !text;
    if (!text) return;
    const tokens = this.message.usage?.completion_tokens_details?.reasoning_tokens;
    const length = tokens ? `${tokens} tokens` : `${text.length} characters`;
    const running = this.message.state === "streaming" && !this.message.content ? "Thinking" : "Reasoning";
    this.reasoning.querySelector("summary").textContent = `${running} (${length})`;
    clear(this.reasoning.querySelector(".reasoning-body")).append(renderMarkdown(text));
  }

  updateImages() {
    const images = this.message.images ?? [];
    this.images.hidden = !images.length;
    clear(this.images).append(...images.map((image) => {
      const url = this.imageUrl(image.id);
      if (url) return el("img", { src: url, alt: image.name ?? "image", title: image.name ?? "" });
      return el("div", { class: "image-missing", title: image.name ?? "",
        text: url === null ? "Image not kept: the browser's storage did not take it." : "Reading the image\u2026" });
    }));
  }

  updateNote() {
    const m = this.message;
    const note = m.state === "error" ? `Error: ${m.error}` : STATE_NOTES[m.state]
      ?? (m.finish_reason === "length" ? STATE_NOTES.length : "");
    this.note.textContent = note;
    this.note.hidden = !note;
    this.note.classList.toggle("error", m.state === "error");
  }

  updateButtons() {
    clear(this.buttons);
    if (this.message.state === "streaming" || this.editing) return;
    const button = (label, handler) => el("button", { type: "button", text: label, on: { click: handler } });
    const copy = button("Copy", async () => {
      await copyText(this.message.content ?? "");
      copy.textContent = "Copied";
    });
    this.buttons.append(copy, button("Edit", () => this.startEditing()));
    if (this.message.role === "assistant") {
      this.buttons.append(button("Regenerate", () => this.actions.regenerate(this.message)));
    }
  }

  startEditing() {
    if (this.actions.busy()) return;
    this.editing = true;
    const area = el("textarea", { class: "edit", value: this.message.content ?? "", rows: 4 });
    const done = () => {
      this.editing = false;
      this.update();
    };
    const save = (resend) => {
      this.editing = false;
      this.actions.edit(this.message, area.value, resend);
    };
    const buttons = [el("button", { type: "button", text: "Cancel", on: { click: done } })];
    if (this.message.role === "user") {
      buttons.push(el("button", { type: "button", class: "primary", text: "Save and send", on: { click: () => save(true) } }));
    } else {
      buttons.push(el("button", { type: "button", class: "primary", text: "Save", on: { click: () => save(false) } }));
    }
    clear(this.content).append(area, el("div", { class: "edit-actions" }, buttons));
    this.updateButtons();
    area.focus();
  }
}

function toolCard(call) {
  let args = call.function?.arguments ?? "";
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    // shown as the model wrote it
  }
  return el("div", { class: "tool-call" },
    el("div", { class: "tool-head" }, el("span", { class: "tool-label", text: "Tool call" }),
      el("span", { class: "tool-name", text: call.function?.name ?? "?" }),
      call.id ? el("span", { class: "tool-id", text: call.id }) : null),
    el("pre", {}, el("code", { text: args })));
}

function figures(message) {
  const t = message.timings;
  if (!t) return "";
  const parts = [`prompt ${t.prompt_n + t.cache_n} tokens (${t.cache_n} cached)`];
  if (t.predicted_n > 0) {
    parts.push(`first token ${Math.round(t.queue_ms + t.prompt_ms)} ms`);
    parts.push(`${t.predicted_n} tokens`);
    if (t.predicted_per_second > 0) parts.push(`${t.predicted_per_second.toFixed(1)} tok/s`);
  }
  return parts.join(" \u00b7 ");
}
