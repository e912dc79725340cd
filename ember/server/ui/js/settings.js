// The settings panel: each field read, checked and saved as it changes. `requestFields` turns
// them into Chat Completions fields; an invalid entry is named rather than sent.

export class Settings {
  constructor(store) {
    this.store = store;
    this.fields = {
      system: document.getElementById("set-system"),
      temperature: document.getElementById("set-temperature"),
      top_p: document.getElementById("set-top-p"),
      max_tokens: document.getElementById("set-max-tokens"),
      thinking: document.getElementById("set-thinking"),
      thinking_budget: document.getElementById("set-thinking-budget"),
      extra: document.getElementById("set-extra"),
    };
    this.message = document.getElementById("settings-error");
    this.reasoning = false;
    for (const [name, field] of Object.entries(this.fields)) {
      const value = store.settings[name];
      if (field.type === "checkbox") field.checked = !!value;
      else field.value = value ?? "";
      field.addEventListener("input", () => this.read(name));
      field.addEventListener("change", () => this.read(name));
    }
  }

  showThinking(reasoning) {
    this.reasoning = reasoning;
    document.getElementById("thinking-settings").hidden = !reasoning;
  }

  read(name) {
    const field = this.fields[name];
    this.store.settings[name] = field.type === "checkbox" ? field.checked
      : field.type === "number" ? (field.value === "" ? null : Number(field.value)) : field.value;
    this.store.saveSettings();
    const problem = this.problem();
    this.message.textContent = problem ?? "";
    this.message.hidden = !problem;
  }

  problem() {
    const s = this.store.settings;
    if (s.temperature !== null && !(s.temperature >= 0)) return "Temperature must be 0 or more.";
    if (s.top_p !== null && !(s.top_p > 0 && s.top_p <= 1)) return "Top-p must be above 0 and at most 1.";
    if (s.max_tokens !== null && !(Number.isInteger(s.max_tokens) && s.max_tokens >= 1)) {
      return "Max tokens must be a whole number of at least 1 (or empty).";
    }
    if (s.thinking_budget !== null && !(Number.isInteger(s.thinking_budget) && s.thinking_budget >= 0)) {
      return "The thinking budget must be a whole number (or empty).";
    }
    return extraFields(s.extra).error ?? null;
  }

  // The request's fields from the settings; throws an Error naming the setting at fault.
  requestFields() {
    const problem = this.problem();
    if (problem) throw new Error(`Settings: ${problem}`);
    const s = this.store.settings;
    const fields = {};
    if (s.temperature !== null) fields.temperature = s.temperature;
    if (s.top_p !== null) fields.top_p = s.top_p;
    if (s.max_tokens !== null) fields.max_tokens = s.max_tokens;
    if (this.reasoning) {
      fields.enable_thinking = !!s.thinking;
      if (s.thinking && s.thinking_budget) fields.thinking_budget = s.thinking_budget;
    }
    return { ...fields, ...extraFields(s.extra).value };
  }

  get systemPrompt() {
    return this.store.settings.system ?? "";
  }
}

function extraFields(text) {
  if (!text || !text.trim()) return { value: {} };
  try {
    const value = JSON.parse(text);
    if (value && typeof value === "object" && !Array.isArray(value)) return { value };
  } catch {
    // reported below
  }
  return { error: "The extra request fields must be a JSON object, such as {\"seed\": 1}." };
}
