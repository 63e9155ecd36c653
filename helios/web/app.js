// The helios web page: a chat playground over /v1/chat/completions, the model card with its
// sampling controls, and a live view of /metrics?format=json. Plain JS, no build step: the server
// ships this file as is (helios/web), so everything here runs in any current browser.
"use strict";

// -- shared state and helpers --------------------------------------------------------------------

const KEY_STORAGE = "helios.apiKey"; // sessionStorage only: the key lives as long as this tab
const POLL_MS = 1000;
const HISTORY = 60; // samples kept per plot (a minute at one poll a second)
const SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p"];
const INTEGER_FIELDS = new Set(["top_k"]);

const state = {
  model: null, // the first card of GET /v1/models
  history: [], // the conversation sent on each turn (system prompt excluded: it is read per send)
  controller: null, // AbortController of the stream in flight, null when idle
};
window.heliosPolls = 0; // successful metrics polls (tests wait on it)
window.heliosLastReply = null; // what the last finished reply reported (usage, timings)

const $ = (id) => document.getElementById(id);

function setState(value) {
  document.body.dataset.state = value;
  $("send").textContent = value === "streaming" ? "Stop" : "Send";
}

function formatNumber(value, digits = 1) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  const magnitude = Math.abs(value);
  if (magnitude >= 1e9) return `${(value / 1e9).toFixed(digits)}G`;
  if (magnitude >= 1e6) return `${(value / 1e6).toFixed(digits)}M`;
  if (magnitude >= 1e4) return `${(value / 1e3).toFixed(digits)}k`;
  return Number.isInteger(value) ? String(value) : value.toFixed(digits);
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text; // server text is never parsed as HTML
  return node;
}

// -- API access and the key prompt ---------------------------------------------------------------

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// Every call carries the tab's key when there is one; a 401 opens the key prompt. Paths are
// absolute: the same page is served at / and at /ui/index.html.
async function api(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...init, headers });
  if (response.ok) return response;
  const message = await errorMessage(response);
  if (response.status === 401) askForKey(key ? "That key was refused; try another." : null);
  throw new HttpError(response.status, message);
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body?.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function askForKey(message) {
  const form = $("key-form");
  if (message) $("key-message").textContent = message;
  if (form.hidden) {
    form.hidden = false;
    $("api-key").focus();
  }
}

function saveKey(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  $("api-key").value = "";
  $("key-form").hidden = true;
  loadModel();
}

// -- model card and sampling controls ------------------------------------------------------------

async function loadModel() {
  $("card-message").textContent = "";
  try {
    const cards = await (await api("/v1/models")).json();
    const card = cards?.data?.[0];
    if (!card) throw new Error("the server lists no model");
    state.model = card;
    showCard(card);
  } catch (error) {
    $("card-message").textContent = `Model card unavailable: ${error.message}`;
  }
}

function showCard(card) {
  const flare = card.flare || {};
  $("model-id").textContent = card.id;
  const facts = [
    ["id", card.id],
    ["max_model_len", card.max_model_len],
    ["default_max_tokens", flare.default_max_tokens],
    ["max_concurrency", flare.max_concurrency],
    ["learned drafter", flare.learned_drafter ? "yes" : "no"],
    ["inputs", (flare.input_modalities || []).join(", ")],
  ];
  const list = $("model-card");
  list.replaceChildren();
  for (const [name, value] of facts) {
    if (value === undefined || value === null || value === "") continue;
    list.append(element("dt", "", name), element("dd", "", String(value)));
  }
  const defaults = flare.sampling_defaults || {};
  const ranges = flare.sampling_ranges || {};
  for (const name of SAMPLING_FIELDS) {
    const input = $(name);
    const range = ranges[name];
    input.value = defaults[name] ?? "";
    // null means the core fixes this field at its default: the server would ignore a value.
    input.disabled = range === null;
    input.min = range ? range.min : "";
    input.max = range ? range.max : "";
    input.title = range === null ? "fixed at the core's default" : range ? `${range.min} … ${range.max}` : "";
  }
  const maxTokens = $("max_tokens");
  maxTokens.max = card.max_model_len ?? "";
  maxTokens.value = flare.default_max_tokens ?? "";
  $("seed").value = defaults.seed ?? "";
}

// An input's value clamped to its min/max (what the request sends), or null when left empty.
function inputValue(input, integer) {
  if (input.disabled || input.value.trim() === "") return null;
  let value = Number(input.value);
  if (!Number.isFinite(value)) return null;
  if (input.min !== "") value = Math.max(value, Number(input.min));
  if (input.max !== "") value = Math.min(value, Number(input.max));
  return integer ? Math.round(value) : value;
}

function clampInput(event) {
  const input = event.target;
  const value = inputValue(input, input.step === "1");
  if (value !== null && String(value) !== input.value) input.value = value;
}

function samplingBody() {
  const body = {};
  for (const name of SAMPLING_FIELDS) {
    const value = inputValue($(name), INTEGER_FIELDS.has(name));
    if (value !== null) body[name] = value;
  }
  const maxTokens = inputValue($("max_tokens"), true);
  if (maxTokens !== null) body.max_tokens = maxTokens;
  const seed = inputValue($("seed"), true);
  if (seed !== null) body.seed = seed;
  return body;
}

// -- chat ----------------------------------------------------------------------------------------

// The data of each server-sent event of a fetch body, as strings ("[DONE]" included).
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let newline;
    while ((newline = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, newline).replace(/\r$/, "");
      buffer = buffer.slice(newline + 1);
      if (line === "") {
        if (data.length) yield data.join("\n");
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).replace(/^ /, ""));
      } // comments (":") and other fields (event:, id:) carry nothing the page uses
    }
  }
  if (data.length) yield data.join("\n");
}

function addMessage(role) {
  const box = element("div", `message ${role}`);
  const parts = {
    box,
    reasoning: element("div", "reasoning"),
    content: element("div", "content"),
    tools: element("div", "tools"),
  };
  parts.reasoning.hidden = true;
  parts.tools.hidden = true;
  box.append(parts.reasoning, parts.content, parts.tools);
  $("messages").append(box);
  return parts;
}

function scrollToEnd() {
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

// One reply's view: text nodes grow as deltas arrive (appendData, not re-rendering the reply).
class ReplyView {
  constructor() {
    this.parts = addMessage("assistant");
    this.text = document.createTextNode("");
    this.reasoning = document.createTextNode("");
    this.parts.content.append(this.text);
    this.parts.reasoning.append(this.reasoning);
    this.calls = []; // {name, arguments, node} by tool-call index
  }

  apply(delta) {
    let visible = false;
    if (delta.reasoning_content) {
      this.parts.reasoning.hidden = false;
      this.reasoning.appendData(delta.reasoning_content);
      visible = true;
    }
    if (delta.content) {
      this.text.appendData(delta.content);
      visible = true;
    }
    for (const call of delta.tool_calls || []) {
      visible = true;
      this.applyCall(call);
    }
    return visible;
  }

  // Tool calls may arrive whole or in pieces (name first, then argument fragments by index).
  applyCall(call) {
    const index = call.index ?? this.calls.length;
    if (!this.calls[index]) {
      const node = element("pre", "tool-call");
      this.calls[index] = { name: "", arguments: "", node };
      this.parts.tools.append(node);
      this.parts.tools.hidden = false;
    }
    const entry = this.calls[index];
    entry.name += call.function?.name || "";
    entry.arguments += call.function?.arguments || "";
    entry.node.textContent = `${entry.name}(${entry.arguments})`;
  }

  fail(message) {
    this.parts.box.append(element("div", "error", message));
  }
}

// The Send button is Stop while a reply streams; Enter only ever sends.
function sendOrStop() {
  if (state.controller) state.controller.abort();
  else send();
}

async function send() {
  if (state.controller) return; // one reply at a time
  const text = $("prompt").value.trim();
  if (!text) return;
  if (!state.model) await loadModel();
  if (!state.model) return; // the card message (or the key prompt) says why

  const turn = { role: "user", content: text };
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...state.history, turn];
  const body = {
    model: state.model.id,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    ...samplingBody(),
  };

  $("prompt").value = "";
  addMessage("user").content.textContent = text;
  const reply = new ReplyView();
  scrollToEnd();
  const controller = new AbortController();
  state.controller = controller;
  setState("streaming");
  const started = performance.now();
  let firstAt = null;
  let usage = null;
  let finishReason = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    for await (const data of sseEvents(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the stream failed"); // no [DONE] follows
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (reply.apply(choice.delta || {}) && firstAt === null) firstAt = performance.now();
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
      scrollToEnd();
    }
  } catch (error) {
    if (error.name === "AbortError") finishReason = "stopped";
    else reply.fail(error.message);
  } finally {
    state.controller = null;
    const answer = reply.text.data;
    // A failed turn is left out of the history so the next turn does not build on it.
    if (finishReason) state.history.push(turn, { role: "assistant", content: answer });
    showStats(usage, started, firstAt, performance.now(), finishReason);
    setState("idle");
  }
}

function showStats(usage, started, firstAt, ended, finishReason) {
  const completion = usage?.completion_tokens ?? null;
  const ttft = firstAt === null ? null : firstAt - started;
  // The decode rate: tokens after the first over the time after the first (TTFT is its own stat).
  const seconds = firstAt === null ? 0 : (ended - firstAt) / 1000;
  const perSecond = completion > 1 && seconds > 0 ? (completion - 1) / seconds : null;
  const stats = {
    prompt_tokens: usage?.prompt_tokens ?? null,
    completion_tokens: completion,
    cached_tokens: usage?.prompt_tokens_details?.cached_tokens ?? null,
    ttft_ms: ttft,
    tokens_per_second: perSecond,
  };
  window.heliosLastReply = { ...stats, finish_reason: finishReason };
  const labels = {
    prompt_tokens: ["prompt", ""],
    completion_tokens: ["completion", ""],
    cached_tokens: ["cached", ""],
    ttft_ms: ["first token", " ms"],
    tokens_per_second: ["speed", " tok/s"],
  };
  const box = $("stats");
  box.replaceChildren();
  for (const [name, [label, unit]] of Object.entries(labels)) {
    const value = element("span", "", formatNumber(stats[name], name === "ttft_ms" ? 0 : 1));
    value.dataset.stat = name;
    const item = element("span", "stat", `${label} `);
    item.append(value, unit);
    box.append(item);
  }
  if (finishReason) box.append(element("span", "stat finish", finishReason));
}

function reset() {
  state.controller?.abort();
  state.history = [];
  $("messages").replaceChildren();
  $("stats").replaceChildren();
  $("prompt").focus();
}

// -- live server view ----------------------------------------------------------------------------

// Each plot: its unit and lines. Rates are deltas of the server's counters between two polls, as
// `helios top` derives them (helios/dashboard.py); gauges are read as they are.
const PLOTS = {
  throughput: { unit: "tok/s", lines: [["generated", "#4cc9f0"], ["prefill", "#f8961e"]] },
  ttft: { unit: "ms", lines: [["median", "#90be6d"]] }, // over the server's last 60 s
  requests: { unit: "", lines: [["active", "#4cc9f0"], ["pending", "#f94144"], ["http", "#bdb2ff"]] },
  kv: { unit: "pages", lines: [["used", "#4cc9f0"], ["cached", "#90be6d"]] },
  reuse: { unit: "tok/s", lines: [["GPU", "#90be6d"], ["host", "#f8961e"]] },
  hits: { unit: "/s", lines: [["prefix", "#90be6d"], ["host", "#f8961e"]] },
  "spec-depth": { unit: "", lines: [["drafts/round", "#bdb2ff"]] },
  "spec-accept": { unit: "%", lines: [["accepted", "#90be6d"]], ceiling: 100 },
};
const samples = Object.fromEntries(Object.keys(PLOTS).map((name) => [name, []]));
let previous = null; // {at, data} of the last successful poll

function count(data, name) {
  const value = data?.[name];
  return typeof value === "number" && Number.isFinite(value) ? value : 0;
}

function record(name, values) {
  const series = samples[name];
  series.push(values);
  if (series.length > HISTORY) series.shift();
}

function ratio(numerator, denominator) {
  return denominator > 0 ? numerator / denominator : null;
}

function recordSnapshot(data, at) {
  // A restarted server (uptime went back) starts its counters again: no rate across it.
  const old = previous && count(data, "uptime_seconds") >= count(previous.data, "uptime_seconds") ? previous : null;
  const seconds = old ? (at - old.at) / 1000 : 0;
  if (old && seconds > 0) {
    const delta = (name) => Math.max(0, count(data, name) - count(old.data, name));
    const rate = (name) => delta(name) / seconds;
    record("throughput", [rate("generated_tokens"), rate("prefill_tokens")]);
    record("reuse", [rate("reused_tokens"), rate("host_reused_tokens")]);
    record("hits", [rate("prefix_cache_hits"), rate("host_hits")]);
    // DEPTH as in `helios top`: drafts per verification round over the interval (none without rounds).
    record("spec-depth", [ratio(delta("verification_drafts"), delta("verification_rounds"))]);
    const accepted = ratio(delta("accepted_drafts"), delta("verification_drafts"));
    record("spec-accept", [accepted === null ? null : accepted * 100]);
  }
  const median = data.first_response?.median_seconds;
  record("ttft", [typeof median === "number" ? median * 1000 : null]);
  record("requests", [count(data, "active"), count(data, "pending"), count(data, "http_inflight_requests")]);
  record("kv", [Math.max(0, count(data, "total_pages") - count(data, "free_pages")), count(data, "cached_pages")]);
  previous = { at, data };
}

function showServerFacts(data) {
  const mib = count(data, "kv_pool_bytes") / 2 ** 20;
  $("server-facts").textContent = [
    `uptime ${count(data, "uptime_seconds")} s`,
    `completed ${count(data, "completed")}`,
    `failed ${count(data, "failed")}`,
    `cancelled ${count(data, "cancelled")}`,
    `KV ${count(data, "total_pages")} pages × ${count(data, "page_tokens")} tokens (${mib.toFixed(0)} MiB ${data.kv_pool_dtype || ""})`,
    `HTTP slots ${count(data, "http_admission_slots_used")}/${count(data, "http_admission_slots")}`,
  ].join(" · ");
}

async function poll() {
  try {
    const data = await (await api("/metrics?format=json")).json();
    recordSnapshot(data, performance.now());
    showServerFacts(data);
    drawPlots();
    window.heliosPolls += 1;
    $("server-status").textContent = "live";
    $("server-status").className = "status ok";
  } catch (error) {
    // Shown, never thrown: the server may be restarting, and the next poll will tell.
    $("server-status").textContent = `metrics unavailable: ${error.message}`;
    $("server-status").className = "status bad";
  }
}

async function pollForever() {
  await poll();
  setTimeout(pollForever, POLL_MS); // after the answer, so slow polls never pile up
}

// -- plotting ------------------------------------------------------------------------------------

function drawPlots() {
  for (const canvas of document.querySelectorAll("canvas.plot")) {
    const name = canvas.dataset.series;
    if (PLOTS[name]) drawPlot(canvas, PLOTS[name], samples[name]);
  }
}

// Lines right-aligned (newest sample at the right edge), scaled to the window's peak; a null
// sample (nothing to measure in that interval) breaks its line.
function drawPlot(canvas, spec, series) {
  const ratioPx = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (!width || !height) return;
  if (canvas.width !== Math.round(width * ratioPx) || canvas.height !== Math.round(height * ratioPx)) {
    canvas.width = Math.round(width * ratioPx);
    canvas.height = Math.round(height * ratioPx);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratioPx, 0, 0, ratioPx, 0, 0);
  ctx.clearRect(0, 0, width, height);

  const legendHeight = 14;
  const top = legendHeight + 4;
  const bottom = height - 3;
  const values = series.flat().filter((v) => v !== null && Number.isFinite(v));
  const peak = spec.ceiling ?? Math.max(1, ...values);
  const x = (i) => width - 2 - (series.length - 1 - i) * ((width - 4) / (HISTORY - 1));
  const y = (v) => bottom - (v / peak) * (bottom - top);

  ctx.strokeStyle = "rgba(255,255,255,0.08)";
  ctx.lineWidth = 1;
  for (const level of [0, 0.5, 1]) {
    ctx.beginPath();
    ctx.moveTo(0, Math.round(y(peak * level)) + 0.5);
    ctx.lineTo(width, Math.round(y(peak * level)) + 0.5);
    ctx.stroke();
  }

  ctx.lineWidth = 1.5;
  ctx.lineJoin = "round";
  spec.lines.forEach(([, color], line) => {
    ctx.strokeStyle = color;
    ctx.beginPath();
    let drawing = false;
    series.forEach((sample, i) => {
      const v = sample[line];
      if (v === null || !Number.isFinite(v)) {
        drawing = false;
        return;
      }
      if (drawing) ctx.lineTo(x(i), y(v));
      else ctx.moveTo(x(i), y(v));
      drawing = true;
    });
    ctx.stroke();
  });

  // Legend: each line's newest value in its colour; the scale's peak at the right, on the row
  // below when the legend leaves no room for it.
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "top";
  let left = 2;
  const newest = series[series.length - 1] || [];
  spec.lines.forEach(([label, color], line) => {
    const text = `${label} ${formatNumber(newest[line])}`;
    ctx.fillStyle = color;
    ctx.fillText(text, left, 2);
    left += ctx.measureText(text).width + 10;
  });
  const scale = `${formatNumber(peak)} ${spec.unit}`.trim();
  const crowded = left + ctx.measureText(scale).width > width - 2;
  ctx.fillStyle = "rgba(255,255,255,0.45)";
  ctx.textAlign = "right";
  ctx.fillText(scale, width - 2, crowded ? top + 2 : 2);
  ctx.textAlign = "left";
}

// -- start ---------------------------------------------------------------------------------------

function start() {
  $("send").addEventListener("click", sendOrStop);
  $("reset").addEventListener("click", reset);
  $("key-form").addEventListener("submit", saveKey);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  for (const name of [...SAMPLING_FIELDS, "max_tokens", "seed"]) $(name).addEventListener("change", clampInput);
  window.addEventListener("resize", drawPlots);
  setState("idle");
  loadModel();
  pollForever();
}

start();
