// WebSocket sessions (`GET /v1/ws`, worker/PROTOCOL.md): JSON messages both ways, frames from
// the worker as binary messages (a header, then a JPEG or an H.264 access unit), camera
// pictures to it as binary messages (protocol 2).

import { JpegCamera } from "./camera.js";
import { cameraMessage, parseHeader } from "./frames.js";

const MAX_DECODING = 8; // pictures waiting for a decoder before newer JPEGs are skipped
const US_PER_FRAME = 62500; // 16 fps: WebCodecs timestamps, as the protocol suggests

export class WsTransport {
  /**
   * `output`: "jpeg" or "h264" (WebCodecs). `on`: { status(msg), meta(header),
   * frame(picture, header) (an ImageBitmap or a VideoFrame; the callee closes it),
   * error(message) (the worker's error message), warn(message) (a problem on this side),
   * closed({code, reason}) }; `closed` only for a session that had opened (before that, `open`
   * rejects).
   */
  constructor(token, output, on) {
    this.token = token;
    this.output = output;
    this.on = on;
    this.socket = null;
    this.hello = null;
    this.accepts = new Set();
    this.decoding = 0;
    this.chain = Promise.resolve();
    this.decoder = null; // WebCodecs, for H.264
    this.headers = new Map(); // frame index → header, while its H.264 picture decodes
    this.camera = null;
    this.pictureId = 0;
  }

  /** Opens the session; resolves with the worker's first status message. */
  open(camera) {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const query = new URLSearchParams();
    if (this.output === "h264") query.set("output", "h264");
    if (this.token) query.set("token", this.token);
    const socket = new WebSocket(`${scheme}://${location.host}/v1/ws?${query}`);
    socket.binaryType = "arraybuffer";
    this.socket = socket;
    return new Promise((resolve, reject) => {
      socket.onmessage = (e) => {
        if (typeof e.data !== "string") return this.onFrame(e.data);
        const msg = parseJson(e.data);
        if (!msg) return this.on.warn("the worker sent a message that is not JSON");
        if (!this.hello && msg.type === "status" && msg.session !== undefined) {
          this.hello = msg;
          // Protocol 1 took controls only; protocol 2 added camera pictures and the first image.
          const v2 = msg.protocol >= 2 ? ["camera", "image"] : [];
          // Protocol 3 added the mode message (world or edit).
          const v3 = msg.protocol >= 3 ? ["mode"] : [];
          this.accepts = new Set(["controls", "prompt", "reset", ...v2, ...v3]);
          this.setCamera(camera);
          resolve(msg);
        }
        if (msg.type === "error") this.on.error(msg.message);
        else this.on.status(msg);
      };
      socket.onclose = (e) => {
        const info = { code: e.code, reason: e.reason };
        this.stopCamera();
        if (this.hello) this.on.closed(info);
        else reject(Object.assign(new Error("the WebSocket closed before the session started"), info));
      };
    });
  }

  onFrame(buffer) {
    const header = parseHeader(buffer);
    if (!header) return this.on.warn("the worker sent a binary message that is not a frame");
    this.on.meta(header);
    const picture = new Uint8Array(buffer, header.offset);
    if (header.codec === "h264") return this.decodeH264(picture, header);
    if (this.decoding >= MAX_DECODING) return; // this page is behind: skip the picture
    this.decoding += 1;
    // Decodes run in parallel but draw in arrival order.
    const decoded = createImageBitmap(new Blob([picture], { type: "image/jpeg" }));
    this.chain = this.chain
      .then(() => decoded)
      .then((bitmap) => this.on.frame(bitmap, header))
      .catch((e) => this.on.warn(`a frame did not decode: ${e.message}`))
      .finally(() => (this.decoding -= 1));
  }

  /** H.264 Annex-B access units through WebCodecs; after an error, waits for the next IDR. */
  decodeH264(data, header) {
    if (!this.decoder) {
      if (typeof VideoDecoder === "undefined") return this.on.warn("this browser has no WebCodecs: choose WebSocket (JPEG)");
      if (!header.keyframe) return; // a decoder starts at a keyframe
      this.decoder = new VideoDecoder({
        output: (frame) => {
          const index = Math.round(frame.timestamp / US_PER_FRAME);
          const h = this.headers.get(index);
          this.headers.delete(index);
          this.on.frame(frame, h ?? header);
        },
        error: (e) => {
          this.on.warn(`H.264 decoding failed (${e.message}); waiting for the next keyframe`);
          this.decoder = null;
          this.headers.clear();
        },
      });
      this.decoder.configure({ codec: "avc1.42e01f", optimizeForLatency: true });
    }
    this.headers.set(header.index, header);
    const type = header.keyframe ? "key" : "delta";
    try {
      this.decoder.decode(new EncodedVideoChunk({ type, timestamp: header.index * US_PER_FRAME, data }));
    } catch (e) {
      this.on.warn(`H.264 decoding failed (${e.message}); waiting for the next keyframe`);
      this.decoder = null;
      this.headers.clear();
    }
  }

  send(msg) {
    if (this.socket?.readyState !== WebSocket.OPEN) return false;
    this.socket.send(JSON.stringify(msg));
    return true;
  }

  /** Sends a binary camera message (JPEG); false when the socket is not open. */
  sendPicture(jpeg, firstImage = false) {
    if (this.socket?.readyState !== WebSocket.OPEN) return false;
    this.pictureId += 1;
    this.socket.send(cameraMessage(jpeg, this.pictureId, performance.now() * 1000, firstImage));
    return true;
  }

  /** Sends world mode's first image (a JPEG). */
  sendImage(jpeg) {
    return this.accepts.has("image") && this.sendPicture(jpeg, true);
  }

  /** Streams the camera as JPEG pictures (null: stops); false when the worker does not take them. */
  setCamera(stream) {
    this.stopCamera();
    if (!stream || !this.hello || !this.accepts.has("camera")) return false;
    const size = { width: this.hello.width, height: this.hello.height };
    this.camera = new JpegCamera(stream, size, this.hello.fps || 16, (jpeg) => {
      // A socket that is not draining: skip pictures rather than queue them.
      if (this.socket.bufferedAmount < 256 * 1024) this.sendPicture(jpeg);
    });
    return true;
  }

  stopCamera() {
    this.camera?.stop();
    this.camera = null;
  }

  teardown() {
    this.stopCamera();
    if (this.decoder?.state === "configured") this.decoder.close();
    this.decoder = null;
  }

  close() {
    this.teardown();
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
