// Worker frames: the binary frame header of the WebSocket protocol and drawing onto the canvas.

export const HEADER_LEN = 44;
const MAGIC = "WLF1";

/**
 * Reads a frame message's header (worker/PROTOCOL.md): magic `WLF1`, then little-endian u64s
 * index, control_id, input_us, pixels_us, sent_us. Returns null when it is not a frame.
 */
export function parseHeader(buffer) {
  if (buffer.byteLength < HEADER_LEN) return null;
  const view = new DataView(buffer);
  const magic = String.fromCharCode(...new Uint8Array(buffer, 0, 4));
  if (magic !== MAGIC) return null;
  const u64 = (i) => Number(view.getBigUint64(4 + 8 * i, true));
  return { index: u64(0), controlId: u64(1), inputUs: u64(2), pixelsUs: u64(3), sentUs: u64(4) };
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
      this.canvas.style.setProperty("--aspect", `${width} / ${height}`);
    }
    this.ctx.drawImage(source, 0, 0, width, height);
  }

  clear() {
    this.ctx.fillStyle = "#000";
    this.ctx.fillRect(0, 0, this.canvas.width, this.canvas.height);
  }
}
