// Conversations, settings and drafts in the browser's local storage (an attached image as its id,
// name and type: its data is in images.js); the API key in session storage.

import { newId } from "./dom.js";

const CONVERSATIONS = "ember.conversations.v1";
const SETTINGS = "ember.settings.v1";
const CURRENT = "ember.current.v1";
const DRAFTS = "ember.drafts.v1";
const API_KEY = "ember.apiKey";
export const UNTITLED = "New chat";
const TITLE_CHARS = 48;
const IMAGE_TITLE = "Image";

// `model`: the picked model's id; null, the server's first.
export const DEFAULT_SETTINGS = Object.freeze({
  system: "", temperature: 0.7, top_p: 0.95, max_tokens: null, thinking: true, thinking_budget: null, extra: "",
  model: null,
});

function read(storage, key, fallback) {
  try {
    const text = storage.getItem(key);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback;  // unreadable (another version, or edited by hand): start over rather than break
  }
}

// A failed write (the storage is full, or forbidden) is reported to `onError`, never thrown.
function write(storage, key, value, onError) {
  try {
    storage.setItem(key, JSON.stringify(value));
  } catch (error) {
    onError(error);
  }
}

export class Store {
  constructor(onError) {
    this.onError = onError;
    const saved = read(localStorage, CONVERSATIONS, []);
    this.conversations = Array.isArray(saved) ? saved.filter((c) => c && Array.isArray(c.messages)) : [];
    this.settings = { ...DEFAULT_SETTINGS, ...read(localStorage, SETTINGS, {}) };
    this.drafts = read(localStorage, DRAFTS, {});
    this.currentId = read(localStorage, CURRENT, null);
    if (!this.current) this.currentId = this.sorted[0]?.id ?? this.create().id;
  }

  get current() {
    return this.conversations.find((c) => c.id === this.currentId) ?? null;
  }

  // Newest activity first.
  get sorted() {
    return [...this.conversations].sort((a, b) => b.updated - a.updated);
  }

  create() {
    const now = Date.now();
    const conversation = { id: newId(), title: UNTITLED, created: now, updated: now, messages: [] };
    this.conversations.push(conversation);
    this.select(conversation.id);
    return conversation;
  }

  select(id) {
    this.currentId = id;
    write(localStorage, CURRENT, id, this.onError);
  }

  touch(conversation) {
    conversation.updated = Date.now();
    const first = conversation.messages.find((m) => m.role === "user");
    if (conversation.title === UNTITLED && first) {
      const line = first.content.trim().split("\n")[0];
      conversation.title = line.length > TITLE_CHARS ? line.slice(0, TITLE_CHARS - 1) + "\u2026"
        : line || (first.images?.length ? IMAGE_TITLE : UNTITLED);
    }
    this.save();
  }

  rename(conversation, title) {
    conversation.title = title.trim() || UNTITLED;
    this.save();
  }

  remove(conversation) {
    this.conversations = this.conversations.filter((c) => c !== conversation);
    delete this.drafts[conversation.id];
    if (this.currentId === conversation.id) this.select(this.sorted[0]?.id ?? this.create().id);
    this.save();
    write(localStorage, DRAFTS, this.drafts, this.onError);
  }

  // The ids of the images every conversation refers to.
  imageIds() {
    return new Set(this.conversations.flatMap((c) => c.messages.flatMap((m) => (m.images ?? []).map((i) => i.id))));
  }

  save() {
    write(localStorage, CONVERSATIONS, this.conversations, this.onError);
  }

  saveSettings() {
    write(localStorage, SETTINGS, this.settings, this.onError);
  }

  draft(id) {
    return this.drafts[id] ?? "";
  }

  setDraft(id, text) {
    if (text) this.drafts[id] = text;
    else delete this.drafts[id];
    write(localStorage, DRAFTS, this.drafts, this.onError);
  }
}

export function exportFile(conversations) {
  const body = { exported_by: "ember", version: 1, exported_at: new Date().toISOString(), conversations };
  return new Blob([JSON.stringify(body, null, 2)], { type: "application/json" });
}

export const apiKey = {
  get: () => sessionStorage.getItem(API_KEY),
  set: (key) => sessionStorage.setItem(API_KEY, key),
  clear: () => sessionStorage.removeItem(API_KEY),
};
