// WebRTC sessions (`POST /v1/webrtc/offer`, worker/PROTOCOL.md): the camera as a sent video
// track, the worker's output as a received H.264 track, and a `controls` data channel carrying
// the same JSON messages as the WebSocket protocol plus the worker's status and frame metadata.
// ICE is not trickled: candidates are gathered before the offer is posted.

const GATHER_MS = 5000; // longest wait for ICE gathering; loopback and LAN finish far sooner
const OPEN_MS = 15000; // longest wait for the data channel after the answer
const QUEUE_MAX = 64; // messages kept while the channel is not open yet
const ACCEPTS = ["controls", "prompt", "reset", "camera"];

export class RtcTransport {
  /**
   * `video`: the <video> the output plays in. `on` as for WsTransport, except that frames are
   * not handed over: they play in `video` and `meta` comes from the data channel.
   */
  constructor(token, video, on) {
    this.token = token;
    this.video = video;
    this.on = on;
    this.pc = null;
    this.channel = null;
    this.sender = null;
    this.hello = null;
    this.accepts = new Set();
    this.queue = [];
    this.ended = false;
  }

  /** Negotiates the session; resolves with the worker's first status message. */
  async open(camera) {
    const pc = new RTCPeerConnection({ iceServers: [] });
    this.pc = pc;
    this.channel = pc.createDataChannel("controls", { ordered: true });
    // One video transceiver both ways: the camera goes up (or nothing yet: the track can be
    // swapped later without renegotiating), the worker's frames come down.
    const transceiver = pc.addTransceiver("video", { direction: "sendrecv" });
    this.sender = transceiver.sender;
    preferH264(transceiver);
    const track = camera?.getVideoTracks()[0];
    if (track) await this.sender.replaceTrack(track);
    pc.ontrack = (e) => {
      this.video.srcObject = e.streams[0] ?? new MediaStream([e.track]);
      this.video.play().catch(() => {});
    };
    const hello = this.listen();
    await pc.setLocalDescription(await pc.createOffer());
    await gathered(pc);
    const answer = await this.post(pc.localDescription.sdp);
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
    return withTimeout(hello, OPEN_MS, "the data channel did not open");
  }

  /** Posts the offer; throws with the worker's own words when it says no. */
  async post(sdp) {
    const headers = { "content-type": "application/json" };
    if (this.token) headers.authorization = `Bearer ${this.token}`;
    // No `settings`: the page sends its prompt on the data channel once it opens, as it does
    // over WebSocket, so both transports start a session the same way.
    const body = { type: "offer", sdp };
    if (this.token) body.token = this.token;
    const res = await fetch("/v1/webrtc/offer", { method: "POST", headers, body: JSON.stringify(body) });
    const text = await res.text();
    if (!res.ok) {
      const why = parseJson(text)?.message ?? text.trim();
      throw Object.assign(new Error(`offer refused (HTTP ${res.status}): ${why}`), {
        status: res.status,
        retryAfter: Number(res.headers.get("retry-after")) || 0,
      });
    }
    const answer = parseJson(text);
    if (answer?.type !== "answer" || typeof answer.sdp !== "string") throw new Error("the worker's answer is not an SDP answer");
    return answer;
  }

  /** Wires the data channel and connection state; resolves on the worker's hello. */
  listen() {
    const { pc, channel } = this;
    return new Promise((resolve, reject) => {
      channel.onopen = () => {
        for (const m of this.queue.splice(0)) channel.send(m);
      };
      channel.onmessage = (e) => {
        const msg = typeof e.data === "string" ? parseJson(e.data) : null;
        if (!msg) return this.on.warn("the worker sent a data channel message that is not JSON");
        if (msg.type === "frame") return this.on.meta(frameMeta(msg));
        if (!this.hello && msg.type === "status" && msg.session !== undefined) {
          this.hello = msg;
          // Protocol 3 added the mode message.
          this.accepts = new Set([...ACCEPTS, ...(msg.protocol >= 3 ? ["mode"] : [])]);
          resolve(msg);
        }
        if (msg.type === "error") this.on.error(msg.message);
        else this.on.status(msg);
      };
      // The channel can die while ICE still says connected: either ends the session.
      channel.onclose = () => this.end("the data channel closed", reject);
      pc.onconnectionstatechange = () => {
        if (pc.connectionState === "failed") this.end("the WebRTC connection failed (ICE)", reject);
      };
    });
  }

  end(reason, reject) {
    if (this.ended) return;
    this.ended = true;
    this.teardown();
    if (this.hello) this.on.closed({ code: 0, reason });
    else reject(new Error(reason));
  }

  send(msg) {
    const text = JSON.stringify(msg);
    if (this.channel?.readyState === "open") this.channel.send(text);
    else if (this.channel?.readyState === "connecting" && this.queue.length < QUEUE_MAX) this.queue.push(text);
    else return false;
    return true;
  }

  /** World mode's first image: not taken over WebRTC. */
  sendImage() {
    return false;
  }

  /** Swaps the sent camera track (null: none) without renegotiating. */
  setCamera(stream) {
    this.sender?.replaceTrack(stream?.getVideoTracks()[0] ?? null);
    return true;
  }

  teardown() {
    if (this.channel) this.channel.onclose = null;
    this.pc?.close();
    this.video.srcObject = null;
  }

  close() {
    this.ended = true;
    this.teardown();
  }

  /** Ends the connection as a network failure would (tests and debugging: the page reconnects). */
  drop() {
    this.pc.close();
    this.end("dropped by the page", () => {});
  }
}

/** Puts H.264 first so the worker's output codec is the browser's first choice. */
function preferH264(transceiver) {
  const caps = RTCRtpReceiver.getCapabilities?.("video");
  if (!caps || !transceiver.setCodecPreferences) return;
  const h264 = caps.codecs.filter((c) => c.mimeType === "video/H264");
  const rest = caps.codecs.filter((c) => c.mimeType !== "video/H264");
  if (h264.length) transceiver.setCodecPreferences([...h264, ...rest]);
}

/** Waits until ICE gathering completes, or GATHER_MS (then posts what it has). */
function gathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      pc.removeEventListener("icegatheringstatechange", check);
      resolve();
    };
    const check = () => pc.iceGatheringState === "complete" && done();
    const timer = setTimeout(done, GATHER_MS);
    pc.addEventListener("icegatheringstatechange", check);
  });
}

function frameMeta(m) {
  return {
    index: m.index,
    controlId: m.control_id ?? 0,
    inputUs: m.input_us ?? 0,
    pixelsUs: m.pixels_us ?? 0,
    sentUs: m.sent_us ?? 0,
  };
}

function withTimeout(promise, ms, why) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(why)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

function parseJson(text) {
  try {
    return JSON.parse(text);
  } catch {
    return null;
  }
}
