// The Worldline browser client: wires the page to a session (WebSocket or WebRTC), the camera,
// keys and mouse, and the live overlay. Settings (transport, auth token, prompt, mode, first
// image) outlive a session: a reconnect sends them again.

import { Camera, toJpeg } from "./camera.js";
import { Renderer } from "./frames.js";
import { Controls } from "./input.js";
import { RtcTransport } from "./rtc.js";
import { Stats } from "./stats.js";
import { WsTransport } from "./ws.js";

const $ = (id) => document.getElementById(id);
const RETRY_MS = [1000, 2000, 4000, 8000];
const STORE = "worldline.settings";
const LOG_LINES = 40;

const settings = { transport: "ws", token: "", prompt: "", mode: "world", strength: 0.6, ...loadSettings() };
const TRANSPORTS = ["ws", "ws-h264", "webrtc"];
if (!TRANSPORTS.includes(settings.transport)) settings.transport = "ws";
const stats = new Stats();
const renderer = new Renderer($("output"));
const camera = new Camera($("preview"));
const controls = new Controls((msg) => {
  stats.controlSent(msg.id, performance.now());
  send(msg);
}, showKeys);

let session = null; // the open (or opening) transport
let wanted = false; // the user asked for a session: reconnect when it drops
let retries = 0;
let retryTimer = null;
let refusals = 0; // WebSocket upgrades refused in a row while the worker said it was ready
let workerSaid = null; // the last error the worker sent in this session
let image = null; // the first image as a JPEG (ArrayBuffer), sent again on reconnect

// ---- sessions -------------------------------------------------------------------------------

function connect() {
  wanted = true;
  retries = 0;
  refusals = 0;
  start();
}

function disconnect() {
  wanted = false;
  clearTimeout(retryTimer);
  const s = session;
  session = null;
  s?.close();
  setState("idle", "disconnected");
  refreshCaps();
  refreshStatus();
}

async function start() {
  clearTimeout(retryTimer);
  setState("connecting", retries ? `reconnecting (try ${retries + 1})` : "connecting");
  stats.reset();
  workerSaid = null;
  const on = { status: onStatus, meta: (m) => stats.meta(m), frame: onFrame, error: onWorkerError, warn: onWarning };
  const t =
    settings.transport === "webrtc"
      ? new RtcTransport(settings.token, $("remote"), on)
      : new WsTransport(settings.token, settings.transport === "ws-h264" ? "h264" : "jpeg", on);
  on.closed = (info) => session === t && onClosed(info);
  session = t;
  showOutput(settings.transport);
  try {
    const hello = await t.open(camera.stream);
    if (session === t) onOpen(hello);
  } catch (e) {
    if (session !== t) return; // the user disconnected meanwhile
    session = null;
    t.close();
    await onFailed(e);
  }
}

function onOpen(hello) {
  retries = 0;
  refusals = 0;
  hideError();
  setState("live", `live · session ${hello.session}`);
  const output = hello.output ?? "jpeg";
  log(`session ${hello.session}: ${hello.model} ${hello.width}×${hello.height} @ ${hello.fps} fps, ${output} over ${settings.transport === "webrtc" ? "WebRTC" : "WebSocket"}`);
  $("placeholder").hidden = true;
  $("stage").style.setProperty("--aspect", `${hello.width} / ${hello.height}`);
  refreshCaps();
  // What the session was set to before: the worker starts every session from scratch.
  if (settings.prompt) send({ type: "prompt", text: settings.prompt });
  if (session.accepts.has("mode")) send(modeMessage());
  if (image) session.sendImage(image);
  cameraNote();
  controls.flush(); // held keys stay held; the first frames then carry a control id
  refreshStatus();
}

/** The session had opened and now ended. */
function onClosed({ code, reason }) {
  session = null;
  refreshCaps();
  if (!wanted) return;
  const why = reason || (code ? `code ${code}` : "connection lost");
  if (workerSaid) {
    // The worker said why: trying again would only repeat it.
    wanted = false;
    setState("error", "closed by the worker");
    showError(`The worker closed the session: ${workerSaid}`);
    return;
  }
  log(`session ended: ${why}`);
  retry();
}

/** The session never opened. */
async function onFailed(e) {
  if (e.status === 401 || e.status === 403) return fatal(`The worker refused the session: wrong or missing auth token (${e.message})`);
  if (e.status === 404) return fatal("This worker has no WebRTC endpoint (built without the media feature?): use WebSocket");
  if (e.status === 503) return retry(`worker busy: every session slot is taken`, e.retryAfter * 1000);
  if (e.status >= 400 && e.status < 500) return fatal(e.message);
  if (settings.transport !== "webrtc") {
    // A browser does not see why a WebSocket upgrade failed: ask the worker whether it is busy.
    const ready = await fetch("/readyz", { cache: "no-store" }).then((r) => r.status, () => 0);
    if (ready === 0) return retry("the worker is unreachable");
    if (ready === 503) return retry("worker busy: every session slot is taken");
    if (workerSaid) return fatal(`The worker refused the session: ${workerSaid}`);
    // Ready now, but a slot may have come free just after the refusal: try once more first.
    refusals += 1;
    if (refusals < 2) return retry("the worker refused the WebSocket; trying once more", 500);
    const h264 = settings.transport === "ws-h264" ? ", or it has no H.264 output (a build without media)" : "";
    return fatal(`The worker refused the WebSocket: wrong or missing auth token${h264}?`);
  }
  retry(e.message);
}

function retry(why, delayMs) {
  if (!wanted) return;
  const delay = delayMs || RETRY_MS[Math.min(retries, RETRY_MS.length - 1)];
  retries += 1;
  if (why) log(why);
  setState("connecting", `reconnecting in ${Math.round(delay / 1000)} s`);
  retryTimer = setTimeout(start, delay);
}

function fatal(message) {
  wanted = false;
  setState("error", "not connected");
  showError(message);
  refreshCaps();
}

function send(msg) {
  return session?.send(msg) ?? false;
}

// ---- what the worker sends ------------------------------------------------------------------

function onStatus(msg) {
  if (msg.session !== undefined) return; // the hello, shown by onOpen
  const { type, ...rest } = msg;
  log(`worker: ${Object.entries(rest).map(([k, v]) => `${k}: ${typeof v === "string" ? v : JSON.stringify(v)}`).join(" · ")}`);
}

function onWorkerError(message) {
  workerSaid = message;
  log(`worker error: ${message}`, true);
  showError(message);
}

/** A decoded WebSocket frame: an ImageBitmap (JPEG) or a VideoFrame (H.264). */
function onWarning(message) {
  log(message, true);
  showError(message);
}

function onFrame(picture, header) {
  renderer.draw(picture, picture.displayWidth ?? picture.width, picture.displayHeight ?? picture.height);
  picture.close();
  stats.drawn(performance.now(), header.controlId);
}

/** WebRTC output plays in its <video>; each frame it shows is counted. */
function countVideoFrames() {
  const video = $("remote");
  if (!video.requestVideoFrameCallback) return;
  const onVideoFrame = () => {
    // A video frame does not carry its metadata: the newest metadata's control id stands in.
    if (session) stats.drawn(performance.now(), stats.lastControl);
    video.requestVideoFrameCallback(onVideoFrame);
  };
  video.requestVideoFrameCallback(onVideoFrame);
}

/** The canvas shows WebSocket frames, the <video> WebRTC's track. */
function showOutput(transport) {
  $("output").hidden = transport === "webrtc";
  $("remote").hidden = transport !== "webrtc";
}

// ---- the page -------------------------------------------------------------------------------

function setState(state, text) {
  $("state").dataset.state = state;
  $("state").textContent = text;
  const busy = state === "live" || state === "connecting";
  $("connect").textContent = busy ? "Disconnect" : "Connect";
  $("connect").classList.toggle("primary", !busy);
  $("transport").disabled = busy;
  $("token").disabled = busy;
  if (!busy) $("placeholder").hidden = false;
}

/** Enables what the session takes; with no session every setting can be chosen for the next. */
function refreshCaps() {
  const can = (kind) => !session?.hello || session.accepts.has(kind);
  for (const r of document.querySelectorAll("input[name=mode]")) r.disabled = !can("mode");
  $("strength").disabled = !can("mode");
  $("image").disabled = !can("image");
  $("reset").disabled = !session?.hello;
  const notes = [];
  if (!can("mode")) notes.push("This worker streams world mode only.");
  if (!can("image")) notes.push("It takes no first image on this transport.");
  $("session-note").textContent = notes.join(" ");
  cameraNote();
}

function cameraNote() {
  let text = "";
  if (camera.on && session?.hello) {
    text = session.accepts.has("camera")
      ? "Sent to the worker."
      : "Preview only: this worker takes no camera frames on this transport.";
  }
  $("camera-note").textContent = text;
}

function showError(message) {
  $("error-text").textContent = message;
  $("error").hidden = false;
}

function hideError() {
  $("error").hidden = true;
}

function log(text, isError = false) {
  const li = document.createElement("li");
  li.textContent = `${new Date().toLocaleTimeString()} ${text}`;
  li.classList.toggle("error", isError);
  $("log").prepend(li);
  while ($("log").children.length > LOG_LINES) $("log").lastChild.remove();
}

function showKeys(held) {
  for (const k of document.querySelectorAll("kbd[data-key]")) k.classList.toggle("held", held.has(k.dataset.key));
}

function ms(p50, p90) {
  return Number.isNaN(p50) ? "–" : `${p50.toFixed(0)} / ${p90.toFixed(0)} ms`;
}

function drawOverlay() {
  const s = stats.summary(performance.now());
  $("ov-fps").textContent = s.fps.toFixed(1);
  $("ov-pixels").textContent = ms(s.pixelsP50, s.pixelsP90);
  $("ov-screen").textContent = ms(s.screenP50, s.screenP90);
  $("ov-frames").textContent = String(s.frames);
  $("ov-drops").textContent = String(s.drops);
}

async function refreshStatus() {
  try {
    const s = await fetch("/status", { cache: "no-store" }).then((r) => r.json());
    $("worker-info").textContent = `${s.model} · ${s.device} · ${s.resolution} @ ${s.fps} fps · sessions ${s.sessions.active}/${s.sessions.max}`;
    const random = s.weights?.state === "random";
    $("weights").hidden = !random;
    $("weights").textContent = "random weights: the output is noise";
  } catch {
    $("worker-info").textContent = "worker status unavailable";
  }
}

// ---- settings -------------------------------------------------------------------------------

/** The `mode` message: edit mode carries its strength (protocol 3). */
function modeMessage() {
  return settings.mode === "edit" ? { type: "mode", mode: "edit", strength: settings.strength } : { type: "mode", mode: "world" };
}

function loadSettings() {
  try {
    return JSON.parse(sessionStorage.getItem(STORE)) ?? {};
  } catch {
    return {};
  }
}

function saveSettings() {
  sessionStorage.setItem(STORE, JSON.stringify(settings));
}

async function readImage(file) {
  if (!file.type.startsWith("image/")) throw new Error(`${file.name} is not an image`);
  const bitmap = await createImageBitmap(file);
  // Sent at the stream's size, as a JPEG: the worker never sees the original file.
  const { width, height } = session?.hello ?? { width: bitmap.width, height: bitmap.height };
  try {
    return await toJpeg(bitmap, width, height, 0.9);
  } finally {
    bitmap.close();
  }
}

function cameraToSession() {
  if (!session?.hello) return;
  session.setCamera(camera.stream);
  cameraNote();
}

// ---- wiring ---------------------------------------------------------------------------------

function wire() {
  $("transport").value = settings.transport;
  $("token").value = settings.token;
  $("prompt").value = settings.prompt;
  for (const r of document.querySelectorAll("input[name=mode]")) r.checked = r.value === settings.mode;
  $("strength").value = String(settings.strength);
  $("strength-value").textContent = String(settings.strength);

  $("connect").onclick = () => (wanted ? disconnect() : connect());
  $("transport").onchange = (e) => {
    settings.transport = e.target.value;
    showOutput(settings.transport);
    saveSettings();
  };
  $("token").onchange = (e) => {
    settings.token = e.target.value;
    saveSettings();
  };
  $("prompt-form").onsubmit = (e) => {
    e.preventDefault();
    settings.prompt = $("prompt").value.trim();
    saveSettings();
    if (send({ type: "prompt", text: settings.prompt })) log(`prompt sent: ${settings.prompt || "(empty)"}`);
    else log("prompt saved: it is sent when a session starts");
  };
  for (const r of document.querySelectorAll("input[name=mode]")) {
    r.onchange = () => {
      settings.mode = r.value;
      saveSettings();
      if (session?.accepts.has("mode")) send(modeMessage());
    };
  }
  $("strength").onchange = (e) => {
    settings.strength = Number(e.target.value);
    $("strength-value").textContent = String(settings.strength);
    saveSettings();
    if (settings.mode === "edit" && session?.accepts.has("mode")) send(modeMessage());
  };
  $("image").onchange = async (e) => {
    const file = e.target.files[0];
    if (!file) return;
    try {
      image = await readImage(file);
      if (session?.sendImage(image)) log(`first image sent: ${file.name}`);
      else log(`first image kept: it is sent when a session that takes it starts`);
    } catch (err) {
      showError(`The first image could not be read: ${err.message}`);
    }
  };
  $("reset").onclick = () => send({ type: "reset" });
  $("camera").onclick = async () => {
    try {
      if (camera.on) camera.stop();
      else await camera.start();
    } catch (err) {
      showError(`The camera did not start: ${err.message}`);
    }
    $("camera").textContent = camera.on ? "Camera off" : "Camera on";
    $("camera").setAttribute("aria-pressed", String(camera.on));
    cameraToSession();
  };
  $("error-close").onclick = hideError;

  const typing = (el) => el.closest?.("input, textarea, select");
  addEventListener("keydown", (e) => !typing(e.target) && controls.key(e, true) && e.preventDefault());
  addEventListener("keyup", (e) => controls.key(e, false));
  addEventListener("blur", () => controls.releaseAll());
  const stage = $("stage");
  stage.onclick = () => session?.hello && stage.requestPointerLock?.();
  addEventListener("mousemove", (e) => {
    if (document.pointerLockElement === stage) controls.move(e.movementX, e.movementY);
  });

  setInterval(drawOverlay, 250);
  showOutput(settings.transport);
  countVideoFrames();
  refreshStatus();
  refreshCaps();
  renderer.clear();
}

wire();

// For the console and the browser test: the live numbers and the session.
window.worldline = {
  summary: () => stats.summary(performance.now()),
  get session() {
    return session;
  },
};
