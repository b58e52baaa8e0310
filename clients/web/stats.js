// Live numbers for the overlay, from the frame metadata the worker sends (worker/PROTOCOL.md)
// and from when frames reach the screen here.

const KEEP = 240; // latency samples kept: about 15 s of frames at 16 fps
const FPS_WINDOW_MS = 2000;

/** p-th percentile (0..1) of `values`, nearest rank; NaN when empty. */
export function percentile(values, p) {
  if (values.length === 0) return NaN;
  const sorted = [...values].sort((a, b) => a - b);
  const rank = Math.ceil(p * sorted.length) - 1;
  return sorted[Math.min(sorted.length - 1, Math.max(0, rank))];
}

export class Stats {
  constructor() {
    this.reset();
  }

  /** Starts over (a new session: frame indices begin again at 0). */
  reset() {
    this.frames = 0; // frames drawn
    this.drops = 0; // frame indices the worker numbered that never arrived
    this.nextIndex = 0;
    this.drawTimes = []; // performance.now() of recent draws
    this.pixels = []; // recent input→pixels samples, ms (worker clock)
    this.pixelsCount = 0; // all of them, as the worker's histogram counts them
    this.screen = []; // input→screen samples, ms (this page's clock)
    this.lastControl = 0; // newest control id a frame depended on
    this.lastSent ??= 0; // newest control id sent (ids keep counting across sessions)
    this.sampledPixelsUs = -1;
    this.sentAt = new Map(); // control id → performance.now() when sent
  }

  /** A controls message went out. */
  controlSent(id, at) {
    this.lastSent = id;
    this.sentAt.set(id, at);
    if (this.sentAt.size > 256) this.sentAt.delete(this.sentAt.keys().next().value);
  }

  /**
   * A frame's metadata arrived: {index, controlId, inputUs, pixelsUs}. The worker measures
   * input→pixels on every frame of the first chunk that depends on a new control message; so
   * does this: the frames that share the pixel time of the first frame with a new control id.
   */
  meta(m) {
    if (m.index > this.nextIndex) this.drops += m.index - this.nextIndex;
    this.nextIndex = Math.max(this.nextIndex, m.index + 1);
    if (m.controlId === 0) return;
    const fresh = m.controlId !== this.lastControl;
    if (fresh || m.pixelsUs === this.sampledPixelsUs) {
      this.sampledPixelsUs = m.pixelsUs;
      push(this.pixels, (m.pixelsUs - m.inputUs) / 1000);
      this.pixelsCount += 1;
    }
    this.lastControl = m.controlId;
  }

  /** A frame reached the canvas; `controlId` is what it depends on (0: none or unknown). */
  drawn(now, controlId) {
    this.frames += 1;
    this.drawTimes.push(now);
    while (this.drawTimes.length && now - this.drawTimes[0] > FPS_WINDOW_MS) this.drawTimes.shift();
    const sent = this.sentAt.get(controlId);
    if (sent !== undefined) {
      push(this.screen, now - sent);
      this.sentAt.delete(controlId); // only the first frame that shows it
    }
  }

  fps(now) {
    const recent = this.drawTimes.filter((t) => now - t <= FPS_WINDOW_MS);
    if (recent.length < 2) return 0;
    return ((recent.length - 1) * 1000) / (recent[recent.length - 1] - recent[0]);
  }

  summary(now) {
    return {
      fps: this.fps(now),
      frames: this.frames,
      drops: this.drops,
      lastControl: this.lastControl,
      lastSent: this.lastSent,
      pixelsSamples: this.pixelsCount,
      pixelsP50: percentile(this.pixels, 0.5),
      pixelsP90: percentile(this.pixels, 0.9),
      screenSamples: this.screen.length,
      screenP50: percentile(this.screen, 0.5),
      screenP90: percentile(this.screen, 0.9),
    };
  }
}

function push(list, v) {
  list.push(v);
  if (list.length > KEEP) list.shift();
}
