// The local camera (getUserMedia), shown as a small preview.

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
