// Which of the server's models the page talks to: a selector in the header, shown only when the
// server has several, each model with its state; the pick is kept with the settings. With one
// model the header shows its name alone.

import { clear, el } from "./dom.js";

// The card's `state` as the selector words it.
const STATE_WORDS = { unloaded: "not loaded", loading: "loading", ready: "ready", unloading: "unloading", failed: "failed" };

export class ModelPicker {
  // onPick(model): the user picked another model.
  constructor(store, onPick) {
    this.store = store;
    this.models = [];
    this.select = document.getElementById("model-select");
    this.name = document.getElementById("model-name");
    this.select.addEventListener("change", () => {
      this.store.settings.model = this.select.value;
      this.store.saveSettings();
      this.name.textContent = this.picked.id;
      onPick(this.picked);
    });
  }

  // The kept pick, or the server's default (its first model) when the server does not list it.
  get picked() {
    return this.models.find((m) => m.id === this.store.settings.model) ?? this.models[0];
  }

  // The server's models as api.js fetchModels lists them; returns the picked one.
  setModels(models) {
    this.models = models;
    const several = models.length > 1;
    this.select.hidden = !several;
    this.name.hidden = several;
    this.name.textContent = this.picked.id;
    if (several) this.render();
    return this.picked;
  }

  // Options are relabelled in place when the list is the same, so that a refresh does not close
  // a selector the user has open.
  render() {
    const options = [...this.select.options];
    const same = options.length === this.models.length && options.every((o, i) => o.value === this.models[i].id);
    if (!same) {
      clear(this.select).append(...this.models.map((m) => el("option", { value: m.id })));
    }
    this.models.forEach((model, i) => {
      this.select.options[i].textContent = `${model.id} (${STATE_WORDS[model.state] ?? model.state})`;
    });
    this.select.value = this.picked.id;
  }
}
