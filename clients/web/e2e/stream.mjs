// Drives the browser client in headless Chromium (worker/tests/browser.rs runs it): fake
// camera on, connect, stream, hold W, check the canvas, drop the connection and see the page
// reconnect with its settings, disconnect. Prints what it saw as one JSON line on stdout; the
// Rust test judges it. Never downloads a browser: it runs the Chromium it is given.
//
//   node stream.mjs --url http://127.0.0.1:PORT/ --transport ws|ws-h264|webrtc [--token T]
//        [--chromium /usr/bin/chromium] [--screenshot out.png]

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { chromium } from "playwright-core";

const { values: opt } = parseArgs({
  options: {
    url: { type: "string" },
    transport: { type: "string", default: "ws" },
    token: { type: "string", default: "" },
    chromium: { type: "string", default: "/usr/bin/chromium" },
    screenshot: { type: "string" },
    frames: { type: "string", default: "24" },
  },
});
const WANT_FRAMES = Number(opt.frames);
const PATIENCE_MS = 180_000; // turns a hang into a failure; not a speed limit

const FLAGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--use-fake-device-for-media-stream",
  "--use-fake-ui-for-media-stream",
  // WebRTC on loopback: the worker's candidates are 127.0.0.1 (its --ice-loopback), which
  // Chromium pairs with only when it gathers loopback candidates itself, without mDNS names.
  "--allow-loopback-in-peer-connection",
  "--disable-features=WebRtcHideLocalIpsWithMdns",
];

const profile = mkdtempSync(join(tmpdir(), "worldline-chromium-"));
const pageErrors = [];
const step = (what) => console.error(`[stream.mjs] ${what}`);
let context;
try {
  context = await chromium.launchPersistentContext(profile, {
    executablePath: opt.chromium,
    headless: true,
    args: FLAGS,
    viewport: { width: 1280, height: 860 },
  });
  const page = context.pages()[0] ?? (await context.newPage());
  page.on("pageerror", (e) => pageErrors.push(`page error: ${e.message}`));
  page.on("console", (m) => m.type() === "error" && pageErrors.push(`console: ${m.text()}`));
  const summary = () => page.evaluate(() => window.worldline.summary());
  const until = (fn, arg) => page.waitForFunction(fn, arg, { timeout: PATIENCE_MS, polling: 100 });

  step(`open ${opt.url}`);
  await page.goto(opt.url);
  await until(() => /tiny/.test(document.getElementById("worker-info").textContent));
  await page.selectOption("#transport", opt.transport);
  await page.fill("#token", opt.token);
  await page.dispatchEvent("#token", "change");
  await page.fill("#prompt", "a castle at dusk");
  await page.click("#prompt-form button"); // kept, and sent when a session starts

  step("camera on");
  await page.click("#camera");
  await until(() => document.getElementById("preview").readyState >= 2);

  step(`connect over ${opt.transport}`);
  await page.click("#connect");
  await until((n) => window.worldline.summary().frames >= n, WANT_FRAMES);
  const firstSession = await page.evaluate(() => window.worldline.session.hello.session);

  step("hold W");
  await page.keyboard.down("w");
  const keySent = (await summary()).lastSent;
  // A frame that depends on the W message, and a few more drawn after it.
  await until((id) => window.worldline.summary().lastControl >= id, keySent);
  const afterKey = (await summary()).frames;
  await until((n) => window.worldline.summary().frames >= n + 8, afterKey);
  const keyHeld = await page.evaluate(() => document.querySelector('kbd[data-key="w"]').classList.contains("held"));
  if (opt.screenshot) await page.screenshot({ path: opt.screenshot });
  await page.keyboard.up("w");

  // What the output element shows now (the canvas, or WebRTC's <video>), as pixels.
  const canvas = await page.evaluate(() => {
    const out = [document.getElementById("output"), document.getElementById("remote")].find((e) => !e.hidden);
    const c = document.createElement("canvas");
    c.width = out.videoWidth ?? out.width;
    c.height = out.videoHeight ?? out.height;
    c.getContext("2d").drawImage(out, 0, 0);
    const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    let sum = 0;
    let sq = 0;
    const values = new Set();
    const n = d.length / 4;
    for (let i = 0; i < d.length; i += 4) {
      const y = (d[i] + d[i + 1] + d[i + 2]) / 3;
      sum += y;
      sq += y * y;
      values.add(d[i] | (d[i + 1] << 8) | (d[i + 2] << 16));
    }
    const mean = sum / n;
    const std = Math.sqrt(Math.max(0, sq / n - mean * mean));
    return { width: c.width, height: c.height, mean, std, colours: values.size };
  });
  const overlayFrames = Number(await page.textContent("#ov-frames"));
  const first = await summary();

  step("drop the connection");
  await page.evaluate(() => window.worldline.session.drop());
  await until(
    (old) => (window.worldline.session?.hello?.session ?? 0) > old && window.worldline.summary().frames >= 8,
    firstSession,
  );
  const secondSession = await page.evaluate(() => window.worldline.session.hello.session);
  const again = await summary();
  const log = await page.$$eval("#log li", (lis) => lis.map((li) => li.textContent));
  const errorShown = await page.evaluate(() => !document.getElementById("error").hidden);
  const errorText = await page.textContent("#error-text");

  step("disconnect");
  await page.click("#connect");
  await until(() => document.getElementById("state").dataset.state === "idle");

  console.log(
    JSON.stringify({
      first,
      again,
      overlayFrames,
      keySent,
      keyHeld,
      canvas,
      sessions: [firstSession, secondSession],
      log,
      errorShown,
      errorText,
      pageErrors,
    }),
  );
} catch (e) {
  console.log(JSON.stringify({ failed: String(e?.stack ?? e), pageErrors }));
  process.exitCode = 1;
} finally {
  await context?.close();
  rmSync(profile, { recursive: true, force: true });
}
