// The binary messages of the WebSocket protocol (frames from the worker, camera pictures to it)
// and drawing frames onto the canvas.

const JPEG = 0;
const H264 = 1;

/**
 * Reads a frame message's header (worker/PROTOCOL.md). Protocol 2: magic `WLF2`, u16
 * header_len, codec byte (0 JPEG, 1 H.264), flags (bit 0 keyframe), then u64 index, control_id,
 * input_us, pixels_us, sent_us, camera_id, camera_us. Protocol 1: `WLF1` and the five u64s from
 * index to sent_us (44 bytes, always JPEG). All little-endian. Returns null when it is not a
 * frame; `offset` is where the picture starts.
 */
export function parseHeader(buffer) {
  if (buffer.byteLength < 44) return null;
  const view = new DataView(buffer);
  const magic = String.fromCharCode(...new Uint8Array(buffer, 0, 4));
  const u64 = (at) => Number(view.getBigUint64(at, true));
  if (magic === "WLF1") {
    return { codec: "jpeg", keyframe: true, index: u64(4), controlId: u64(12), inputUs: u64(20), pixelsUs: u64(28), sentUs: u64(36), offset: 44 };
  }
  if (magic !== "WLF2" || buffer.byteLength < 64) return null;
  const offset = view.getUint16(4, true);
  const codec = view.getUint8(6);
  if (offset < 64 || offset > buffer.byteLength || (codec !== JPEG && codec !== H264)) return null;
  return {
    codec: codec === H264 ? "h264" : "jpeg",
    keyframe: (view.getUint8(7) & 1) === 1,
    index: u64(8),
    controlId: u64(16),
    inputUs: u64(24),
    pixelsUs: u64(32),
    sentUs: u64(40),
    cameraId: u64(48),
    cameraUs: u64(56),
    offset,
  };
}

/**
 * A camera message of protocol 2: magic `WLC1`, codec 0 (JPEG), flags (bit 0: world mode's
 * first image rather than a camera frame), 2 reserved bytes, u64 id, u64 capture_us, then the
 * JPEG.
 */
export function cameraMessage(jpeg, id, captureUs, firstImage = false) {
  const out = new Uint8Array(24 + jpeg.byteLength);
  const view = new DataView(out.buffer);
  out.set([0x57, 0x4c, 0x43, 0x31], 0); // "WLC1"
  view.setUint8(4, JPEG);
  view.setUint8(5, firstImage ? 1 : 0);
  view.setBigUint64(8, BigInt(id), true);
  view.setBigUint64(16, BigInt(Math.max(0, Math.round(captureUs))), true);
  out.set(new Uint8Array(jpeg), 24);
  return out;
}

/** The output canvas: sized to the stream, one frame drawn at a time. */
export class Renderer {
  constructor(canvas) {
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d", { alpha: false });
  }

  /** Draws an ImageBitmap, VideoFrame or <video>, resizing the canvas to `width`×`height`. */
  draw(source, width, height) {
    if (this.canvas.width !== width || this.canvas.height !== height) {
      this.canvas.width = width;
      this.canvas.height = height;
    }
    this.ctx.drawImage(source, 0, 0, width, height);
  }

  clear() {
    this.ctx.fillStyle = "#000";
    this.ctx.fillRect(0, 0, this.canvas.width, this.canvas.height);
  }
}
