// Images waiting in the composer: attached with the button (a file picker), by pasting or by
// dropping them on the composer; shown as removable thumbnails until sent. Offered only when the
// model reads images. What the server would refuse by its documented limits (a file that is not
// an image it reads, a file over --max-image-mb, more images in a request than --max-images) is
// refused here, saying why; the rest (a broken or animated image, the media budget) is the
// server's to judge.

import { clear, el, newId } from "./dom.js";

// What ember reads (ember/media/image.py's FORMATS), as browsers name a file's type.
const TYPES = new Map([["image/png", "PNG"], ["image/jpeg", "JPEG"], ["image/webp", "WebP"], ["image/gif", "GIF"]]);
const MIB = 2 ** 20;

export class Attachments {
  // notify(text): shows a refusal; sentImages(): the images the conversation on screen sends
  // already with each request (a request carries the whole conversation).
  constructor({ notify, sentImages }) {
    this.notify = notify;
    this.sentImages = sentImages;
    this.items = [];  // { id, name, type, url }
    this.model = null;  // { vision, maxImages, maxImageBytes } once the server has answered
    this.tray = document.getElementById("attachments");
    this.button = document.getElementById("attach");
    this.picker = document.getElementById("attach-input");
    this.picker.accept = [...TYPES.keys()].join(",");
    this.bind();
  }

  bind() {
    this.button.addEventListener("click", () => this.picker.click());
    this.picker.addEventListener("change", () => {
      this.add([...this.picker.files]);
      this.picker.value = "";  // the same file may be picked again
    });
    document.addEventListener("paste", (event) => {
      const files = [...(event.clipboardData?.files ?? [])];
      if (files.length) this.add(files);  // any text in the clipboard still pastes as usual
    });
    const composer = document.getElementById("composer");
    const carriesFiles = (event) => event.dataTransfer?.types.includes("Files");
    for (const zone of [composer, this.tray]) {
      zone.addEventListener("dragover", (event) => {
        if (!carriesFiles(event)) return;
        event.preventDefault();
        composer.classList.add("dropping");
      });
      zone.addEventListener("dragleave", (event) => {
        if (!zone.contains(event.relatedTarget)) composer.classList.remove("dropping");
      });
      zone.addEventListener("drop", (event) => {
        composer.classList.remove("dropping");
        if (!carriesFiles(event)) return;
        event.preventDefault();
        this.add([...event.dataTransfer.files]);
      });
    }
    // A file dropped beside the composer would make the browser leave the page to show it.
    for (const name of ["dragover", "drop"]) {
      window.addEventListener(name, (event) => {
        if (carriesFiles(event) && !event.defaultPrevented) event.preventDefault();
      });
    }
  }

  // The served model: the button shows only for one that reads images.
  setModel(model) {
    this.model = model;
    this.button.hidden = !model.vision;
  }

  async add(files) {
    if (!this.model?.vision) {
      this.notify("This model reads no images (a text-only model, or a server started with --no-vision).");
      return;
    }
    const problems = [];
    let accepted = files.filter((file) => {
      const problem = this.problem(file);
      if (problem) problems.push(problem);
      return !problem;
    });
    const room = Math.max(this.model.maxImages - this.sentImages() - this.items.length, 0);
    if (accepted.length > room) {
      problems.push(`The server takes at most ${this.model.maxImages} images per request, and each request `
        + `carries the whole conversation's: ${room ? `only the first ${room} of these ${accepted.length} fit` : "no more fit"}. `
        + "Start a new chat for others.");
      accepted = accepted.slice(0, room);
    }
    const read = await Promise.all(accepted.map(readImage));
    if (read.includes(null)) problems.push("The browser could not read one of the files.");
    if (problems.length) this.notify(problems.join(" "));
    this.items.push(...read.filter(Boolean));
    this.render();
  }

  problem(file) {
    const name = file.name ? `\u201c${file.name}\u201d` : "The pasted file";
    if (!TYPES.has(file.type)) {
      return `${name} is not an image ember reads (${[...TYPES.values()].join(", ")}).`;
    }
    if (this.model.maxImageBytes && file.size > this.model.maxImageBytes) {
      return `${name} is ${(file.size / MIB).toFixed(1)} MiB; the server takes images up to `
        + `${+(this.model.maxImageBytes / MIB).toFixed(2)} MiB.`;
    }
    return null;
  }

  // The images to send, which leave the composer.
  take() {
    const items = this.items;
    this.items = [];
    this.render();
    return items;
  }

  // Puts back images whose message the server refused.
  restore(items) {
    this.items = [...items, ...this.items];
    this.render();
  }

  render() {
    clear(this.tray);
    this.tray.hidden = !this.items.length;
    for (const item of this.items) {
      const remove = () => {
        this.items = this.items.filter((other) => other !== item);
        this.render();
      };
      this.tray.append(el("figure", { class: "attachment", dataset: { id: item.id } },
        el("img", { src: item.url, alt: item.name, title: item.name }),
        el("button", { type: "button", class: "remove", "aria-label": `Remove ${item.name}`, title: "Remove",
          text: "\u2715", on: { click: remove } })));
    }
  }
}

function readImage(file) {
  return new Promise((resolve) => {
    const reader = new FileReader();
    reader.onload = () => resolve({ id: newId(), name: file.name || "pasted image", type: file.type, url: reader.result });
    reader.onerror = () => resolve(null);
    reader.readAsDataURL(file);
  });
}
