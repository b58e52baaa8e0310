// The local camera (getUserMedia) with its preview, and the camera as JPEG pictures for
// WebSocket sessions.

export class Camera {
  constructor(preview) {
    this.preview = preview;
    this.stream = null;
  }

  get on() {
    return this.stream !== null;
  }

  async start() {
    if (!navigator.mediaDevices?.getUserMedia) {
      throw new Error("this browser gives no camera access here (it needs https or localhost)");
    }
    this.stream = await navigator.mediaDevices.getUserMedia({
      video: { width: { ideal: 640 }, height: { ideal: 480 }, frameRate: { ideal: 16 } },
      audio: false,
    });
    this.preview.srcObject = this.stream;
    this.preview.hidden = false;
  }

  stop() {
    this.stream?.getTracks().forEach((t) => t.stop());
    this.stream = null;
    this.preview.srcObject = null;
    this.preview.hidden = true;
  }
}

/** A picture (anything drawImage takes) as a JPEG of `width`×`height`: an ArrayBuffer. */
export async function toJpeg(source, width, height, quality = 0.8) {
  const canvas = new OffscreenCanvas(width, height);
  canvas.getContext("2d").drawImage(source, 0, 0, width, height);
  const blob = await canvas.convertToBlob({ type: "image/jpeg", quality });
  return blob.arrayBuffer();
}

/**
 * The camera as JPEG pictures at the stream's size, `fps` a second, handed to `send`. At most
 * one picture is encoded at a time: a tick that finds the encoder busy is skipped, so the
 * worker always gets the newest picture (it keeps only the latest anyway).
 */
export class JpegCamera {
  constructor(stream, { width, height }, fps, send) {
    this.video = document.createElement("video");
    this.video.muted = true;
    this.video.playsInline = true;
    this.video.srcObject = stream;
    this.video.play().catch(() => {});
    let busy = false;
    this.timer = setInterval(async () => {
      if (busy || this.video.readyState < 2) return;
      busy = true;
      try {
        send(await toJpeg(this.video, width, height));
      } finally {
        busy = false;
      }
    }, 1000 / fps);
  }

  stop() {
    clearInterval(this.timer);
    this.video.srcObject = null;
  }
}
