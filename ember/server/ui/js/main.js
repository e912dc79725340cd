// The chat page: wires the store, the server and its models, the settings, the sidebar, the
// composer's images and the messages together.

import { ApiError, describe, fetchModels, streamChat } from "./api.js";
import { Attachments } from "./attachments.js";
import { clear, el, newId } from "./dom.js";
import { ImageStore, isImageUrl } from "./images.js";
import { MessageView } from "./messages.js";
import { ModelPicker } from "./models.js";
import { Settings } from "./settings.js";
import { Sidebar } from "./sidebar.js";
import { apiKey, exportFile, Store } from "./store.js";

const $ = (id) => document.getElementById(id);
const RETRY_MODEL_MS = 3000;

class App {
  constructor() {
    this.store = new Store(() => this.notify(
      "The browser's storage is full or blocked: this conversation may not be kept. Export and delete old ones.",
      "error"));
    this.settings = new Settings(this.store);
    this.sidebar = new Sidebar($("conversations"), this.store, {
      open: (c) => this.open(c),
      rename: (c, title) => this.store.rename(c, title),
      remove: (c) => this.remove(c),
      exportOne: (c) => this.download([c], c.title),
    });
    this.images = new ImageStore();
    this.attachments = new Attachments({
      notify: (text) => this.notify(text, "error"),
      sentImages: () => imagesOf(this.store.current.messages).filter((i) => this.images.url(i.id) !== null).length,
    });
    this.picker = new ModelPicker(this.store, (model) => this.useModel(model));
    this.model = null;  // the picked model (api.js modelOf) once the server has answered
    this.refreshing = false;  // while the models' states are being asked again
    this.running = null;  // { controller, conversation, reply } while a reply streams
    this.views = new Map();  // message id -> MessageView, for the conversation on screen
    this.input = $("input");
    this.bind();
    this.show();
    this.connect();
    this.images.prune(() => this.store.imageIds());
  }

  bind() {
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    this.input.addEventListener("input", () => this.store.setDraft(this.store.currentId, this.input.value));
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && this.running) {
        event.preventDefault();
        this.stop();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("new-chat").addEventListener("click", () => this.newChat());
    $("export-all").addEventListener("click", () => this.download(this.store.sorted, "all"));
    $("toggle-settings").addEventListener("click", () => {
      const panel = $("settings");
      panel.hidden = !panel.hidden;
      $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
    });
    $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.useKey($("key-input").value.trim());
    });
    $("key-dialog").addEventListener("cancel", (event) => event.preventDefault());  // a key is needed to go on
    window.addEventListener("focus", () => this.refreshModels());
  }

  // ---- the server ------------------------------------------------------------------------

  async connect() {
    let models;
    try {
      models = await fetchModels();
    } catch (error) {
      if (error.kind === "auth") return this.askKey(apiKey.get() ? "That key was refused." : null);
      $("model-name").textContent = "not connected";
      this.notify(error.kind === "down" ? "ember cannot be reached: is the server running? Retrying\u2026"
        : describe(error), "error");
      setTimeout(() => this.connect(), RETRY_MODEL_MS);
      return;
    }
    this.useModel(this.picker.setModels(models));
    this.notify(null);
    if (!this.running) this.show();  // replies now carry the model's name
  }

  // What the page derives from the picked model's card.
  useModel(model) {
    this.model = model;
    $("model-context").textContent = model.contextLength ? `context ${model.contextLength} tokens` : "";
    this.settings.showThinking(model.reasoning);
    this.attachments.setModel(model);
  }

  // The models' states again (on focus, after each reply): one request, nothing shown when it
  // fails (the next message says why). Not before the first answer: connect() is still trying.
  async refreshModels() {
    if (!this.model || this.refreshing) return;
    this.refreshing = true;
    try {
      this.useModel(this.picker.setModels(await fetchModels()));
    } catch {
      // kept as it was
    } finally {
      this.refreshing = false;
    }
  }

  askKey(problem) {
    const dialog = $("key-dialog");
    $("key-error").textContent = problem ?? "";
    $("key-error").hidden = !problem;
    if (!dialog.open) dialog.showModal();
    $("key-input").focus();
  }

  async useKey(key) {
    if (!key) return this.askKey("Enter the key the server was started with.");
    apiKey.set(key);
    try {
      await fetchModels();
    } catch (error) {
      if (error.kind === "auth") {
        apiKey.clear();
        return this.askKey("That key was refused.");
      }
    }
    $("key-dialog").close();
    $("key-input").value = "";
    this.connect();
  }

  // ---- conversations ---------------------------------------------------------------------

  show() {
    const conversation = this.store.current;
    const box = $("messages");
    clear(box);
    this.views.clear();
    for (const message of conversation.messages) this.addView(message);
    this.input.value = this.store.draft(conversation.id);
    this.sidebar.render();
    box.scrollTop = box.scrollHeight;
    const ids = imagesOf(conversation.messages).map((i) => i.id);
    if (ids.some((id) => this.images.url(id) === undefined)) {
      this.images.load(ids).then(() => {
        if (this.store.current !== conversation) return;
        for (const view of this.views.values()) view.updateImages();
      });
    }
  }

  addView(message) {
    const view = new MessageView(message, {
      modelName: this.model?.id,
      imageUrl: (id) => this.images.url(id),
      actions: {
        edit: (m, text, resend) => this.edit(m, text, resend),
        regenerate: (m) => this.regenerate(m),
        busy: () => !!this.running,
      },
    });
    this.views.set(message.id, view);
    $("messages").append(view.node);
    return view;
  }

  open(conversation) {
    this.store.select(conversation.id);
    document.body.classList.remove("sidebar-open");
    this.show();
  }

  newChat() {
    const current = this.store.current;
    if (!current.messages.length) return this.open(current);
    this.store.create();
    this.open(this.store.current);
  }

  remove(conversation) {
    if (this.running?.conversation === conversation) this.stop();
    this.store.remove(conversation);
    this.show();
    this.images.prune(() => this.store.imageIds());
  }

  // ---- sending ---------------------------------------------------------------------------

  async send() {
    const text = this.input.value;
    if ((!text.trim() && !this.attachments.items.length) || this.running) return;
    const conversation = this.store.current;
    const images = this.attachments.take();
    const message = { id: newId(), role: "user", content: text };
    if (images.length) message.images = images.map(({ id, name, type }) => ({ id, name, type }));
    conversation.messages.push(message);
    this.input.value = "";
    this.store.setDraft(conversation.id, "");
    this.store.touch(conversation);
    if (images.length) this.keepImages(images);
    this.show();
    await this.reply(conversation, { text, images });
  }

  async keepImages(images) {
    if (await this.images.keep(images)) return;
    this.notify("The browser's storage did not take the image (full or blocked): it stays in this conversation "
      + "until the page is reloaded, then shows as not kept. The conversation's text is kept.", "error");
  }

  // Streams an assistant reply to the conversation as it stands. A refusal before the reply
  // opened takes back the reply (and, for a new message, the message: its text into the input
  // box, its images into the composer). `draft`: { text, images } of a new message.
  async reply(conversation, draft = null) {
    let fields;
    try {
      fields = this.settings.requestFields();
    } catch (error) {
      return this.refused(conversation, draft, error.message);
    }
    const history = conversation.messages.slice();
    const model = this.model;
    const reply = { id: newId(), role: "assistant", content: "", reasoning: "", tool_calls: [], state: "streaming" };
    if (model) reply.model = model.id;
    conversation.messages.push(reply);
    this.addView(reply);
    const controller = new AbortController();
    this.running = { controller, conversation, reply };
    this.setRunning(true);
    if (model && model.state !== "ready") this.loading(model.id);
    let opened = false;
    try {
      await this.images.load(imagesOf(history).map((i) => i.id));  // those not read since the page opened
      const body = {
        ...(model ? { model: model.id } : {}),
        messages: requestMessages(this.settings.systemPrompt, history, (id) => this.images.url(id)),
        stream: true, stream_options: { include_usage: true }, return_progress: true, timings_per_token: true,
        ...fields,
      };
      for await (const chunk of streamChat(body, controller.signal)) {
        opened = true;
        applyChunk(reply, chunk);
        this.progress(chunk.prompt_progress);
        this.redraw(reply, conversation);
      }
      reply.state = "done";
    } catch (error) {
      if (error.name === "AbortError") {
        reply.state = "stopped";
      } else if (!opened && !(error instanceof ApiError && error.opened)) {
        conversation.messages.pop();
        this.views.get(reply.id)?.node.remove();
        this.views.delete(reply.id);
        this.running = null;
        this.setRunning(false);
        if (error.kind === "auth") {
          apiKey.clear();
          this.askKey("The server asks for an API key.");
        }
        return this.refused(conversation, draft, describe(error));
      } else {
        reply.state = "error";
        reply.error = error.message;
      }
    } finally {
      if (this.running?.reply === reply) {
        this.running = null;
        this.setRunning(false);
      }
      this.progress(null);
      this.refreshModels();
    }
    this.store.touch(conversation);
    this.views.get(reply.id)?.update();
  }

  refused(conversation, draft, message) {
    if (draft !== null) {
      conversation.messages.pop();
      this.store.touch(conversation);
      this.images.forget(draft.images.map((i) => i.id));
      if (this.store.current === conversation) {
        this.show();
        this.input.value = draft.text;
        this.store.setDraft(conversation.id, draft.text);
        this.attachments.restore(draft.images);
      }
    }
    this.notify(message, "error");
  }

  // One repaint a frame, of the reply's view on screen (a new one if its conversation was reopened).
  redraw(reply, conversation) {
    if (this.pending) return;
    this.pending = requestAnimationFrame(() => {
      this.pending = null;
      const view = this.views.get(reply.id);
      if (!view || this.store.current !== conversation) return;
      const box = $("messages");
      const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
      view.update();
      if (atEnd) box.scrollTop = box.scrollHeight;
    });
  }

  stop() {
    this.running?.controller.abort();
  }

  setRunning(running) {
    $("send").hidden = running;
    $("stop").hidden = !running;
    if (running) this.notify(null);
  }

  progress(report) {
    const bar = $("progress");
    if (!report || report.processed >= report.total) {
      bar.hidden = true;
      return;
    }
    const share = report.total > report.cache ? (report.processed - report.cache) / (report.total - report.cache) : 1;
    bar.hidden = false;
    $("progress-bar").style.width = `${Math.round(share * 100)}%`;
    $("progress-text").textContent = `Reading the prompt: ${report.processed} of ${report.total} tokens`
      + (report.cache ? ` (${report.cache} cached)` : "");
  }

  // The server holds a request for a model that is not loaded until it is (or its load fails):
  // said in the progress line, which the reply's first chunk takes over.
  loading(id) {
    $("progress").hidden = false;
    $("progress-bar").style.width = "0";
    $("progress-text").textContent = `Loading ${id}\u2026`;
  }

  edit(message, text, resend) {
    const conversation = this.store.current;
    message.content = text;
    if (resend) {
      const index = conversation.messages.indexOf(message);
      conversation.messages.splice(index + 1);
    }
    this.store.touch(conversation);
    this.show();
    if (resend) this.reply(conversation);
  }

  regenerate(message) {
    if (this.running) return;
    const conversation = this.store.current;
    conversation.messages.splice(conversation.messages.indexOf(message));
    this.store.touch(conversation);
    this.show();
    this.reply(conversation);
  }

  // Exports conversations as JSON, each image with its data URL (null where it was not kept).
  async download(conversations, name) {
    await this.images.load(imagesOf(conversations.flatMap((c) => c.messages)).map((i) => i.id));
    const withUrl = (image) => ({ ...image, url: this.images.url(image.id) ?? null });
    saveFile(conversations.map((c) => ({
      ...c, messages: c.messages.map((m) => (m.images ? { ...m, images: m.images.map(withUrl) } : m)),
    })), name);
  }

  notify(text, kind = "info") {
    const notice = $("notice");
    notice.hidden = !text;
    notice.className = kind;
    clear(notice);
    if (text) {
      notice.append(el("span", { text }),
        el("button", { type: "button", class: "dismiss", "aria-label": "Dismiss", text: "\u2715",
          on: { click: () => this.notify(null) } }));
    }
  }
}

// The conversation as Chat Completions messages: replies that failed before any text are left out.
function requestMessages(system, messages, imageUrl) {
  const out = system.trim() ? [{ role: "system", content: system }] : [];
  for (const m of messages) {
    if (m.role === "user") {
      out.push({ role: "user", content: userContent(m, imageUrl) });
    } else if (m.content || m.tool_calls?.length) {
      const message = { role: "assistant", content: m.content };
      if (m.reasoning) message.reasoning_content = m.reasoning;
      if (m.tool_calls?.length) message.tool_calls = m.tool_calls;
      out.push(message);
    }
  }
  return out;
}

// A user message's kept images as image_url parts (data URLs) above its text; text alone stays a string.
function userContent(message, imageUrl) {
  const urls = (message.images ?? []).map((i) => imageUrl(i.id)).filter(isImageUrl);
  if (!urls.length) return message.content;
  const parts = urls.map((url) => ({ type: "image_url", image_url: { url } }));
  if (message.content) parts.push({ type: "text", text: message.content });
  return parts;
}

function imagesOf(messages) {
  return messages.flatMap((m) => m.images ?? []);
}

function applyChunk(reply, chunk) {
  if (chunk.timings) reply.timings = chunk.timings;
  if (chunk.usage) reply.usage = chunk.usage;
  const choice = chunk.choices?.[0];
  if (!choice) return;
  const delta = choice.delta ?? {};
  if (delta.content) reply.content += delta.content;
  if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
  for (const part of delta.tool_calls ?? []) {
    const call = reply.tool_calls[part.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } };
    if (part.id) call.id = part.id;
    if (part.function?.name) call.function.name += part.function.name;
    if (part.function?.arguments) call.function.arguments += part.function.arguments;
  }
  if (choice.finish_reason) reply.finish_reason = choice.finish_reason;
}

function saveFile(conversations, name) {
  const link = el("a", {
    href: URL.createObjectURL(exportFile(conversations)),
    download: `ember-chat-${name.replace(/[^\w-]+/g, "-").slice(0, 40) || "conversation"}.json`,
  });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

new App();
