// WebSocket sessions (`GET /v1/ws`, worker/PROTOCOL.md): JSON messages both ways, frames from
// the worker as binary messages (a 44-byte header, then a JPEG).

import { HEADER_LEN, parseHeader } from "./frames.js";

/** What a protocol-1 worker takes over WebSocket when its hello does not list `accepts`. */
const ACCEPTS_V1 = ["controls", "prompt", "reset"];
const MAX_DECODING = 8; // frames waiting for the JPEG decoder before newer ones are skipped

export class WsTransport {
  /**
   * `on`: { status(msg), meta(header), frame(bitmap, header), error(message),
   * closed({code, reason}) }; `closed` only for a session that had opened (before that, `open`
   * rejects).
   */
  constructor(token, on) {
    this.token = token;
    this.on = on;
    this.socket = null;
    this.hello = null;
    this.accepts = new Set();
    this.decoding = 0;
    this.chain = Promise.resolve();
  }

  /** Opens the session; resolves with the worker's first status message. */
  open() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const query = this.token ? `?token=${encodeURIComponent(this.token)}` : "";
    const socket = new WebSocket(`${scheme}://${location.host}/v1/ws${query}`);
    socket.binaryType = "arraybuffer";
    this.socket = socket;
    return new Promise((resolve, reject) => {
      socket.onmessage = (e) => {
        if (typeof e.data !== "string") return this.onFrame(e.data);
        const msg = parseJson(e.data);
        if (!msg) return this.on.error("the worker sent a message that is not JSON");
        if (!this.hello && msg.type === "status" && msg.session !== undefined) {
          this.hello = msg;
          this.accepts = new Set(msg.accepts ?? ACCEPTS_V1);
          resolve(msg);
        }
        if (msg.type === "error") this.on.error(msg.message);
        else this.on.status(msg);
      };
      socket.onclose = (e) => {
        const info = { code: e.code, reason: e.reason };
        if (this.hello) this.on.closed(info);
        else reject(Object.assign(new Error("the WebSocket closed before the session started"), info));
      };
    });
  }

  onFrame(buffer) {
    const header = parseHeader(buffer);
    if (!header) return this.on.error("the worker sent a binary message that is not a frame");
    this.on.meta(header);
    if (this.decoding >= MAX_DECODING) return; // this page is behind: skip the picture
    this.decoding += 1;
    const jpeg = new Blob([new Uint8Array(buffer, HEADER_LEN)], { type: "image/jpeg" });
    // Decodes run in parallel but draw in arrival order.
    const decoded = createImageBitmap(jpeg);
    this.chain = this.chain
      .then(() => decoded)
      .then((bitmap) => this.on.frame(bitmap, header))
      .catch((e) => this.on.error(`a frame did not decode: ${e.message}`))
      .finally(() => (this.decoding -= 1));
  }

  send(msg) {
    if (this.socket?.readyState !== WebSocket.OPEN) return false;
    this.socket.send(JSON.stringify(msg));
    return true;
  }

  /** Camera frames over WebSocket: not in the protocol yet. */
  setCamera() {
    return this.accepts.has("camera");
  }

  close() {
    this.socket.onclose = null;
    this.socket.onmessage = null;
    this.socket.close(1000, "client disconnected");
  }

  /** Closes the connection as a network failure would (tests and debugging: the page reconnects). */
  drop() {
    this.socket.close(4000, "dropped by the page");
  }
}

function parseJson(text) {
  try {
    return JSON.parse(text);
  } catch {
    return null;
  }
}
