// The page: conversations streamed through /v1/chat/completions, and the engine panel drawn
// from /debug/steps (polled). Nothing is loaded from anywhere but this server.
"use strict";

const $ = (id) => document.getElementById(id);
let model = null;
let chatCount = 0;

// ---- conversations --------------------------------------------------------------------------

function settings() {
  const body = {
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("json-mode").checked) {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "reply", schema: JSON.parse($("schema").value) },
    };
  }
  return body;
}

class Chat {
  constructor() {
    const node = $("chat-template").content.firstElementChild.cloneNode(true);
    this.node = node;
    this.history = []; // {role, content} of the turns so far
    this.controller = null;
    this.messages = node.querySelector(".messages");
    this.input = node.querySelector(".input");
    this.statusEl = node.querySelector(".status");
    this.buttons = {
      send: node.querySelector(".send"),
      stop: node.querySelector(".stop"),
      regen: node.querySelector(".regen"),
    };
    node.querySelector(".title").textContent = `Conversation ${++chatCount}`;
    this.buttons.send.onclick = () => this.send();
    this.buttons.stop.onclick = () => this.stop();
    this.buttons.regen.onclick = () => this.regenerate();
    node.querySelector(".close").onclick = () => { this.stop(); node.remove(); };
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); this.send(); }
    });
    $("chats").appendChild(node);
  }

  setStatus(text) {
    this.statusEl.textContent = text;
    this.node.dataset.status = text;
  }

  busy(on) {
    this.buttons.send.disabled = on;
    this.buttons.stop.disabled = !on;
    this.buttons.regen.disabled = on || !this.history.some((m) => m.role === "assistant");
  }

  bubble(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    div.appendChild(body);
    this.messages.appendChild(div);
    this.messages.scrollTop = this.messages.scrollHeight;
    return div;
  }

  send() {
    const text = this.input.value.trim();
    if (!text || this.controller) return;
    this.input.value = "";
    this.history.push({ role: "user", content: text });
    this.bubble("user", text);
    this.reply();
  }

  regenerate() {
    if (this.controller) return;
    const last = this.history.length - 1;
    if (last < 0 || this.history[last].role !== "assistant") return;
    this.history.pop();
    const bubbles = this.messages.querySelectorAll(".msg.assistant");
    bubbles[bubbles.length - 1].remove();
    this.reply();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  async reply() {
    const system = $("system").value.trim();
    const messages = (system ? [{ role: "system", content: system }] : []).concat(this.history);
    const div = this.bubble("assistant", "");
    const textEl = div.querySelector(".text");
    const meta = document.createElement("span");
    meta.className = "meta";
    div.appendChild(meta);
    this.controller = new AbortController();
    this.busy(true);
    this.setStatus("waiting");
    const t0 = performance.now();
    let first = null;
    let text = "";
    let usage = null;
    let finish = null;
    try {
      const body = Object.assign(
        { model, messages, stream: true, stream_options: { include_usage: true } }, settings());
      const res = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: this.controller.signal,
      });
      if (!res.ok) {
        const err = await res.json().catch(() => ({}));
        throw new Error((err.error && err.error.message) || `HTTP ${res.status}`);
      }
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message);
            if (chunk.usage) usage = chunk.usage;
            for (const choice of chunk.choices || []) {
              const delta = (choice.delta && choice.delta.content) || "";
              if (delta) {
                if (first === null) { first = performance.now(); this.setStatus("streaming"); }
                text += delta;
                textEl.textContent = text;
                this.messages.scrollTop = this.messages.scrollHeight;
              }
              if (choice.finish_reason) finish = choice.finish_reason;
            }
          }
        }
      }
      this.history.push({ role: "assistant", content: text });
      this.setStatus("done");
    } catch (e) {
      if (e.name === "AbortError") {
        this.history.push({ role: "assistant", content: text });
        this.setStatus("stopped");
        finish = "stopped";
      } else {
        textEl.textContent = text + (text ? "\n" : "") + `[error: ${e.message}]`;
        this.setStatus("error");
      }
    } finally {
      this.controller = null;
      const secs = (performance.now() - (first === null ? t0 : first)) / 1000;
      const n = usage ? usage.completion_tokens : null;
      const parts = [];
      if (n !== null) parts.push(`${n} tokens`);
      if (n && secs > 0) parts.push(`${(n / secs).toFixed(1)} tok/s`);
      if (first !== null) parts.push(`first token ${((first - t0) / 1000).toFixed(2)} s`);
      if (finish) parts.push(finish);
      meta.textContent = parts.join(" · ");
      this.busy(false);
    }
  }
}

// ---- the engine panel -----------------------------------------------------------------------

const tokHistory = []; // [unix s, tokens/s]
let lastTotal = null;

function drawSeries(canvas, points, now, color) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const pts = points.filter(([t]) => now - t <= 60);
  if (!pts.length) return;
  const top = Math.max(...pts.map(([, v]) => v)) * 1.15 || 1;
  ctx.strokeStyle = color;
  ctx.fillStyle = color;
  ctx.beginPath();
  pts.forEach(([t, v], i) => {
    const x = w - ((now - t) / 60) * w, y = h - (v / top) * (h - 4) - 2;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  pts.forEach(([t, v]) => {
    ctx.fillRect(w - ((now - t) / 60) * w - 1, h - (v / top) * (h - 4) - 3, 2, 2);
  });
  ctx.fillText(top.toFixed(top < 10 ? 2 : 0), 3, 10);
}

function drawSteps(canvas, steps) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  if (!steps.length) return;
  const n = steps.length, bw = w / Math.max(n, 60);
  const rows = steps.map((s) => s.decode + s.prompt_tokens / 16);
  const top = Math.max(...rows, 1);
  const topMs = Math.max(...steps.map((s) => s.seconds * 1000), 1);
  steps.forEach((s, i) => {
    const x = w - (n - i) * bw;
    const hd = (s.decode / top) * (h - 12), hp = (s.prompt_tokens / 16 / top) * (h - 12);
    ctx.fillStyle = getComputedStyle(document.body).getPropertyValue("--decode");
    ctx.fillRect(x, h - hd, Math.max(bw - 1, 1), hd);
    ctx.fillStyle = getComputedStyle(document.body).getPropertyValue("--prompt");
    ctx.fillRect(x, h - hd - hp, Math.max(bw - 1, 1), hp);
  });
  ctx.strokeStyle = getComputedStyle(document.body).getPropertyValue("--time");
  ctx.beginPath();
  steps.forEach((s, i) => {
    const x = w - (n - i - 0.5) * bw, y = h - (s.seconds * 1000 / topMs) * (h - 12);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = "#1d2330";
  ctx.fillText(`${topMs.toFixed(1)} ms`, 3, 10);
}

function renderSlots(view) {
  const box = $("slots");
  const bySlot = new Map(view.slots.map((s) => [s.slot, s]));
  while (box.children.length < view.max_slots) {
    const d = document.createElement("div");
    d.className = "slot";
    box.appendChild(d);
  }
  [...box.children].forEach((d, i) => {
    const s = bySlot.get(i);
    if (!s) {
      d.className = "slot";
      d.textContent = `slot ${i} · free`;
      return;
    }
    d.className = `slot busy ${s.phase}`;
    d.dataset.request = s.request;
    const what = s.phase === "prompt" ? `prompt ${s.prefilled}/${s.prompt}`
      : `decoding · ${s.generated} tokens`;
    d.textContent = `slot ${i} · ${what}`;
    if (s.phase === "prompt") {
      const bar = document.createElement("div");
      bar.className = "bar";
      bar.style.width = `${(100 * s.prefilled) / Math.max(s.prompt, 1)}%`;
      d.appendChild(bar);
    }
  });
}

async function poll() {
  try {
    const res = await fetch("/debug/steps");
    if (res.status === 503) { $("status").textContent = "loading the model…"; return; }
    const view = await res.json();
    if (model === null) {
      model = view.model;
      $("model").textContent = view.model;
      $("status").textContent = "";
    }
    $("busy").textContent = view.slots.length;
    $("max-slots").textContent = view.max_slots;
    $("queue").textContent = view.queue;
    renderSlots(view);
    const kv = view.kv;
    $("kv-used").textContent = kv.used;
    $("kv-cached").textContent = kv.cached;
    $("kv-free").textContent = kv.free;
    $("kv-total").textContent = kv.total;
    $("kv-block").textContent = kv.block_size;
    $("kv-used-bar").style.width = `${(100 * kv.used) / Math.max(kv.total, 1)}%`;
    $("kv-cached-bar").style.left = `${(100 * kv.used) / Math.max(kv.total, 1)}%`;
    $("kv-cached-bar").style.width =
      `${(100 * Math.max(kv.cached - kv.used, 0)) / Math.max(kv.total, 1)}%`;
    if (lastTotal !== null && view.now > lastTotal[0]) {
      tokHistory.push([view.now, (view.generated_tokens - lastTotal[1]) / (view.now - lastTotal[0])]);
      while (tokHistory.length && view.now - tokHistory[0][0] > 60) tokHistory.shift();
    }
    lastTotal = [view.now, view.generated_tokens];
    const recent = tokHistory.slice(-3);
    const rate = recent.length ? recent.reduce((a, [, v]) => a + v, 0) / recent.length : 0;
    $("toks").textContent = rate.toFixed(0);
    $("ttft").textContent = view.ttft.length
      ? `${view.ttft[view.ttft.length - 1][1].toFixed(2)} s` : "–";
    drawSeries($("toks-plot"), tokHistory, view.now, "#2f6fde");
    drawSeries($("ttft-plot"), view.ttft, view.now, "#e0892b");
    drawSteps($("steps-plot"), view.steps);
    if (view.spec) {
      const s = view.spec;
      $("spec").hidden = false;
      $("spec-text").textContent = `${s.mode}: ${s.accepted} of ${s.proposed} proposals kept, ` +
        `${(s.accepted / Math.max(s.verify_rows, 1)).toFixed(2)} per verify row` +
        (s.active === false ? " (off while measured slower)" : "");
    }
  } catch (e) {
    $("status").textContent = `engine view: ${e.message}`;
  } finally {
    setTimeout(poll, 400);
  }
}

$("json-mode").onchange = () => { $("schema").hidden = !$("json-mode").checked; };
$("add-chat").onclick = () => new Chat();
new Chat();
new Chat();
poll();
