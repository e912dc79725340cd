// Attached images' data URLs, kept apart from the conversations: local storage (a few MiB per
// site, shared by every conversation) holds the text and each image's id, name and type; the
// image itself goes to IndexedDB, whose quota is a share of the disk. An image that IndexedDB
// refuses (full, or blocked) stays on screen and in requests until the page is reloaded, then
// shows as not kept; the text never depends on it.

const DB_NAME = "ember.images";
const STORE = "images";

function done(request) {
  return new Promise((resolve, reject) => {
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}

export class ImageStore {
  constructor() {
    this.urls = new Map();  // id -> data URL, or null: looked up and not kept
    this.db = null;
  }

  // undefined: not looked up yet; null: not kept; else its data URL.
  url(id) {
    return this.urls.get(id);
  }

  open() {
    this.db ??= new Promise((resolve, reject) => {
      const request = indexedDB.open(DB_NAME, 1);
      request.onupgradeneeded = () => request.result.createObjectStore(STORE);
      request.onsuccess = () => resolve(request.result);
      request.onerror = () => reject(request.error);
      request.onblocked = () => reject(new Error("IndexedDB is blocked"));
    });
    return this.db;
  }

  async transaction(mode, work) {
    const db = await this.open();
    const tx = db.transaction(STORE, mode);
    const finished = new Promise((resolve, reject) => {
      tx.oncomplete = resolve;
      tx.onerror = tx.onabort = () => reject(tx.error ?? new Error("the transaction was aborted"));
    });
    // Each request's promise continues in the microtasks of its success event, while the
    // transaction is still active, so `work` may chain requests.
    const [result] = await Promise.all([work(tx.objectStore(STORE)), finished]);
    return result;
  }

  // Keeps `images` ({ id, url }); resolves to whether the browser's storage took them all.
  async keep(images) {
    for (const image of images) this.urls.set(image.id, image.url);
    try {
      await this.transaction("readwrite", (store) => Promise.all(images.map((i) => done(store.put(i.url, i.id)))));
      return true;
    } catch {
      return false;
    }
  }

  // Reads the images of `ids` not looked up yet.
  async load(ids) {
    const wanted = ids.filter((id) => !this.urls.has(id));
    if (!wanted.length) return;
    let found = [];
    try {
      found = await this.transaction("readonly", (store) => Promise.all(wanted.map((id) => done(store.get(id)))));
    } catch {
      // storage blocked: none of them is kept
    }
    wanted.forEach((id, i) => this.urls.set(id, isImageUrl(found[i]) ? found[i] : null));
  }

  async forget(ids) {
    for (const id of ids) this.urls.delete(id);
    try {
      await this.transaction("readwrite", (store) => Promise.all(ids.map((id) => done(store.delete(id)))));
    } catch {
      // nothing kept to delete
    }
  }

  // Deletes the kept images no conversation refers to any more (dropped by an edit, a
  // regeneration, a refused send or a deleted conversation). `referenced()` is read inside the
  // transaction, so an image kept meanwhile is never taken for an orphan.
  async prune(referenced) {
    try {
      await this.transaction("readwrite", async (store) => {
        const keys = await done(store.getAllKeys());
        const keep = referenced();
        await Promise.all(keys.filter((key) => !keep.has(key)).map((key) => done(store.delete(key))));
      });
    } catch {
      // storage blocked: nothing kept
    }
  }
}

export function isImageUrl(value) {
  return typeof value === "string" && value.startsWith("data:image/");
}
