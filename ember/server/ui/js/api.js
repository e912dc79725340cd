// Talking to ember: the API key header, refusals turned into messages a person can act on, and
// the server-sent events of a Chat Completions stream read chunk by chunk.

import { apiKey } from "./store.js";

// `kind`: "auth" (401), "busy" (429), "unavailable" (503: loading, stopping, no slot in time),
// "down" (no answer at all), "refused" (any other status before the stream opened), "stream" (an
// error event after it opened). `opened`: whether the reply had begun.
export class ApiError extends Error {
  constructor(kind, message, { status = null, param = null, retryAfter = null, opened = false } = {}) {
    super(message);
    this.kind = kind;
    this.status = status;
    this.param = param;
    this.retryAfter = retryAfter;
    this.opened = opened;
  }
}

function headers(json) {
  const result = json ? { "Content-Type": "application/json" } : {};
  const key = apiKey.get();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function request(path, options = {}) {
  let response;
  try {
    response = await fetch(path, { ...options, headers: headers(options.body !== undefined) });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError("down", "ember cannot be reached: is the server running? Nothing was sent; your message is kept.");
  }
  if (!response.ok) throw await refusal(response);
  return response;
}

const STATUS_MESSAGES = {
  401: "The server needs an API key.",
  429: "The server is busy; try again in a few seconds.",
  503: "The server cannot take requests now.",
};

async function refusal(response) {
  let message = STATUS_MESSAGES[response.status] ?? `The server answered ${response.status}.`;
  let param = null;
  try {
    const error = (await response.json()).error ?? {};
    if (typeof error.message === "string") message = error.message;
    param = error.param ?? null;
  } catch {
    // not JSON (a proxy's page): the status says enough
  }
  const retryAfter = Number(response.headers.get("Retry-After")) || null;
  const status = response.status;
  const kind = status === 401 ? "auth" : status === 429 ? "busy" : status === 503 ? "unavailable" : "refused";
  return new ApiError(kind, message, { status, param, retryAfter });
}

// The server's models, each once under its public id (a card whose id is its `root`; the cards of
// its aliases are left out), in the server's order: the first is its default.
export async function fetchModels() {
  const body = await (await request("/v1/models")).json();
  const models = (body.data ?? []).filter((card) => card.id === card.root).map(modelOf);
  if (!models.length) throw new ApiError("refused", "The server lists no model.");
  return models;
}

// A card as the page uses it. A model never loaded has only its name and state: the rest is null
// or false until its first request loads it.
function modelOf(card) {
  return {
    id: card.id, state: card.state, contextLength: card.max_model_len ?? null,
    reasoning: !!card.capabilities?.reasoning, vision: !!card.capabilities?.vision,
    maxImages: card.max_images ?? Infinity, maxImageBytes: card.max_image_bytes ?? null,
  };
}

// Yields each JSON chunk of the stream; ends at [DONE]. Aborting `signal` closes the connection,
// which makes the server abort the request and free its KV blocks.
export async function* streamChat(body, signal) {
  const response = await request("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      let part;
      try {
        part = await reader.read();
      } catch (error) {
        if (error.name === "AbortError") throw error;
        throw new ApiError("stream", "The connection to ember was lost mid-reply.", { opened: true });
      }
      if (part.done) return;
      buffer += part.value;
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/\r$/, "");
        buffer = buffer.slice(end + 1);
        if (!line.startsWith("data:")) continue;  // event names, keep-alive comments, blank separators
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError("stream", chunk.error.message ?? "The reply failed.", { opened: true });
        yield chunk;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// What the page says about a refusal: ember's own message, the field at fault, when to retry.
export function describe(error) {
  if (error.kind === "down" || error.kind === "stream") return error.message;
  const field = error.param ? ` (field: ${error.param})` : "";
  const wait = error.retryAfter ? ` Retry after ${error.retryAfter} s.` : "";
  return `${error.message}${field}${wait} Your message is kept.`;
}
