// Keys and mouse → `controls` messages (worker/PROTOCOL.md): the keys held now and the mouse
// motion since the previous message. A message goes out when the held keys change, and at most
// every MOUSE_MS while the mouse moves (the worker coalesces them per chunk anyway).

const KEYS = { KeyW: "w", KeyS: "s", KeyA: "a", KeyD: "d", KeyQ: "q", KeyE: "e", KeyI: "i", KeyK: "k" };
const MOUSE_MS = 50;

export class Controls {
  /** `send(msg)` delivers a message; `onKeys(set)` shows the held keys. */
  constructor(send, onKeys) {
    this.send = send;
    this.onKeys = onKeys;
    this.held = new Set();
    this.mouse = [0, 0];
    this.timer = null;
    this.nextId = 1; // increasing for the whole page, across reconnects
  }

  /** Handles a key event; true when it was one of ours. */
  key(event, down) {
    const k = KEYS[event.code];
    if (!k || event.ctrlKey || event.metaKey || event.altKey) return false;
    if (down === this.held.has(k)) return true; // auto-repeat
    if (down) this.held.add(k);
    else this.held.delete(k);
    this.onKeys(this.held);
    this.flush();
    return true;
  }

  /** Mouse motion in pixels (right and down positive). */
  move(dx, dy) {
    this.mouse[0] += dx;
    this.mouse[1] += dy;
    if (this.timer === null) this.timer = setTimeout(() => this.flush(), MOUSE_MS);
  }

  /** Lets go of every key (the window lost focus: key-up events would never come). */
  releaseAll() {
    if (this.held.size === 0) return;
    this.held.clear();
    this.onKeys(this.held);
    this.flush();
  }

  /** Sends the current state now. Also used after a reconnect, so held keys stay held. */
  flush() {
    clearTimeout(this.timer);
    this.timer = null;
    const id = this.nextId++;
    const keys = [...this.held].sort().join("");
    const mouse = this.mouse.map((v) => Math.round(v * 100) / 100);
    this.mouse = [0, 0];
    this.send({ type: "controls", id, keys, mouse });
  }
}
