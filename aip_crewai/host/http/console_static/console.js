// aip-crewai approval console: a static page over the host's own AIP routes.
// It enforces nothing: the host authenticates every request and checks every decision.
// Sign-in: a bearer token (kept for this tab only) or an Ed25519 key imported as a
// non-extractable WebCrypto key (optionally kept in IndexedDB) that signs every request
// with HTTP Message Signatures (RFC 9421). Live data: SSE read with fetch(), so the
// credential travels in headers and never in a URL. README "Approval console".
"use strict";

const API = "/aip/v1";
const state = { auth: null, approvals: new Map(), selected: null, runAbort: null, liveAbort: null };
const $ = (id) => document.getElementById(id);
const utf8 = new TextEncoder();

// ---------------------------------------------------------------- credentials

function b64(bytes) {
  let text = "";
  for (const b of new Uint8Array(bytes)) text += String.fromCharCode(b);
  return btoa(text);
}

function pemBody(pem) {
  const match = /-----BEGIN PRIVATE KEY-----([\s\S]+?)-----END PRIVATE KEY-----/.exec(pem);
  if (!match) throw new Error("paste a PKCS#8 PEM private key (BEGIN PRIVATE KEY)");
  const raw = atob(match[1].replace(/\s+/g, ""));
  return Uint8Array.from(raw, (c) => c.charCodeAt(0));
}

async function importKey(pem) {
  try {
    return await crypto.subtle.importKey("pkcs8", pemBody(pem), { name: "Ed25519" }, false, ["sign"]);
  } catch (err) {
    if (err instanceof Error && /PKCS#8/.test(err.message)) throw err;
    throw new Error("this browser cannot use the key as Ed25519 (" + (err && err.name || err) + ")");
  }
}

function keyStore(mode, action) {
  return new Promise((resolve, reject) => {
    const open = indexedDB.open("aip-crewai-console", 1);
    open.onupgradeneeded = () => open.result.createObjectStore("keys");
    open.onerror = () => reject(open.error);
    open.onsuccess = () => {
      const tx = open.result.transaction("keys", mode);
      const request = action(tx.objectStore("keys"));
      tx.oncomplete = () => resolve(request && request.result);
      tx.onerror = () => reject(tx.error);
    };
  });
}

// RFC 9421 signature over @method, @target-uri and, with a body, content-digest (RFC 9530).
async function signedHeaders(method, url, body) {
  const headers = {};
  const components = ['"@method"', '"@target-uri"'];
  const lines = [`"@method": ${method}`, `"@target-uri": ${url}`];
  if (body !== undefined) {
    const digest = await crypto.subtle.digest("SHA-256", utf8.encode(body));
    headers["Content-Digest"] = `sha-256=:${b64(digest)}:`;
    components.push('"content-digest"');
    lines.push(`"content-digest": ${headers["Content-Digest"]}`);
  }
  const nonce = b64(crypto.getRandomValues(new Uint8Array(16)));
  const created = Math.floor(Date.now() / 1000);
  const params = `(${components.join(" ")});created=${created};keyid="${state.auth.keyId}";alg="ed25519";nonce="${nonce}"`;
  lines.push(`"@signature-params": ${params}`);
  const signature = await crypto.subtle.sign("Ed25519", state.auth.key, utf8.encode(lines.join("\n")));
  headers["Signature-Input"] = `sig1=${params}`;
  headers["Signature"] = `sig1=:${b64(signature)}:`;
  return headers;
}

async function authHeaders(method, url, body) {
  if (state.auth.kind === "token") return { Authorization: `Bearer ${state.auth.token}` };
  return signedHeaders(method, url, body);
}

// ---------------------------------------------------------------- HTTP

class ApiError extends Error {
  constructor(status, error) {
    super(error && error.message ? error.message : `HTTP ${status}`);
    this.status = status;
    this.code = error && error.code;
  }
}

async function api(method, path, payload) {
  const url = new URL(path, location.origin).href;
  const body = payload === undefined ? undefined : JSON.stringify(payload);
  const headers = { Accept: "application/aip+json, application/json", ...(await authHeaders(method, url, body)) };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(url, { method, headers, body, cache: "no-store" });
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
  if (!response.ok) {
    const error = data && data.body && data.body.error && data.body.error.error;
    throw new ApiError(response.status, error);
  }
  return data;
}

// One SSE stream read with fetch (so requests carry headers); resumes with Last-Event-ID
// until the server ends it for good (204) or `signal` aborts. onEvent(name, data, id).
async function follow(path, onEvent, signal, onState) {
  let lastId = null;
  for (let attempt = 0; !signal.aborted; attempt++) {
    try {
      const url = new URL(path, location.origin).href;
      const headers = { Accept: "text/event-stream", ...(await authHeaders("GET", url)) };
      if (lastId) headers["Last-Event-ID"] = lastId;
      const response = await fetch(url, { headers, signal, cache: "no-store" });
      if (response.status === 204) return;
      if (!response.ok) {
        const error = await response.json().catch(() => null);
        throw new ApiError(response.status, error && error.body && error.body.error && error.body.error.error);
      }
      if (onState) onState(true);
      attempt = 0;
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "", name = "", data = [], id = null;
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.search(/\r\n|\r|\n/)) >= 0) {
          const line = buffer.slice(0, cut);
          buffer = buffer.slice(cut + (buffer.startsWith("\r\n", cut) ? 2 : 1));
          if (line === "") {
            if (data.length) {
              if (id !== null) lastId = id;
              if (onEvent(name || "message", data.join("\n"), id) === "stop") return;
            }
            name = ""; data = []; id = null;
          } else if (line.startsWith(":")) {
            continue;
          } else {
            const colon = line.indexOf(":");
            const field = colon < 0 ? line : line.slice(0, colon);
            const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
            if (field === "event") name = text;
            else if (field === "data") data.push(text);
            else if (field === "id") id = text;
          }
        }
      }
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof ApiError && err.status < 500) throw err;
    }
    if (onState) onState(false);
    await new Promise((resolve) => setTimeout(resolve, Math.min(1000 * 2 ** attempt, 15000)));
  }
}

// ---------------------------------------------------------------- queue

function timeLeft(expiresAt) {
  const ms = Date.parse(expiresAt) - Date.now();
  if (ms <= 0) return "expired";
  const s = Math.floor(ms / 1000);
  return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
}

function renderQueue() {
  const queue = $("queue");
  const pending = [...state.approvals.values()].filter((a) => a.status === "pending")
    .sort((a, b) => a.created_at.localeCompare(b.created_at));
  queue.replaceChildren(...pending.map((approval) => {
    const item = document.createElement("li");
    item.dataset.approvalId = approval.request.id;
    item.setAttribute("aria-selected", String(state.selected === approval.request.id));
    const cap = document.createElement("div");
    cap.className = "cap";
    setFaithful(cap, approval.request.capability_id);
    const meta = document.createElement("div");
    meta.className = "muted";
    setFaithful(meta, `${approval.request.requester.id} · ${timeLeft(approval.request.expires_at)} left`);
    item.append(cap, meta);
    item.addEventListener("click", () => select(approval.request.id));
    return item;
  }));
  $("count").textContent = pending.length ? `(${pending.length})` : "";
  $("queue-empty").hidden = pending.length > 0;
}

async function refreshApproval(approvalId) {
  try {
    const view = await api("GET", `${API}/approvals/${encodeURIComponent(approvalId)}`);
    view.found = await displayFindings(view);
    state.approvals.set(approvalId, view);
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) state.approvals.delete(approvalId);
    else throw err;
  }
  renderQueue();
  if (state.selected === approvalId) renderDetail();
}

async function loadPending() {
  let cursor = null;
  const seen = new Map();
  do {
    const query = new URLSearchParams({ status: "pending", limit: "200" });
    if (cursor) query.set("cursor", cursor);
    const page = await api("GET", `${API}/approvals?${query}`);
    for (const view of page.approvals) seen.set(view.request.id, view);
    cursor = page.cursor;
  } while (cursor);
  for (const [id, view] of state.approvals) if (view.status !== "pending" && !seen.has(id)) seen.set(id, view);
  state.approvals = seen;
  renderQueue();
}

// An approval event's data is an AIP Event whose `data` is the ApprovalRecordView (README "Approval events");
// `ready` (the snapshot's end) carries no approval: the queue is reloaded then.
function approvalIdOf(data) {
  try {
    const value = JSON.parse(data);
    const view = value.data || {};
    return (view.request && view.request.id) || null;
  } catch (_) { return null; }
}

function watchApprovals() {
  state.liveAbort = new AbortController();
  const live = (on) => { $("live").textContent = on ? "live" : "reconnecting"; $("live").className = on ? "badge" : "badge off"; };
  follow(`${API}/approvals/events`, (name, data) => {
    const id = approvalIdOf(data);
    if (id) refreshApproval(id).catch(showError);
    else if (name === "ready") loadPending().catch(showError);
  }, state.liveAbort.signal, live)
    .catch((err) => { $("live").textContent = "no live events"; showError(err); });
}

// ---------------------------------------------------------------- faithful display
// A code point a person would misread (a bidi control, an invisible, control or odd space character, a
// look-alike letter) is drawn as its \u202e-style marker, highlighted, never as itself. The host lists
// them per JSON path for an approval's input (GET .../display, aip_crewai/contracts/display.py: look-alike
// and mixed-script letters come only from that list); `misread` is the same character classes again, a
// safety net for text the host does not list (ids, chunks, results). README "The approval flow".
const BIDI = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/u;
const BLANK = /[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2800\u3164\uffa0\ufe00-\ufe0f\u{e0100}-\u{e01ef}]/u;
const OTHER = /[\p{Cf}\p{Cc}\p{Cs}\p{Zs}\p{Zl}\p{Zp}]/u;

function misread(ch) {
  if (ch === " " || ch === "\t" || ch === "\n" || ch === "\r") return false;
  return BIDI.test(ch) || BLANK.test(ch) || OTHER.test(ch);
}

function marker(ch) {
  let out = "";
  for (let i = 0; i < ch.length; i++) out += "\\u" + ch.charCodeAt(i).toString(16).padStart(4, "0");
  return out;  // the JSON escape: a surrogate pair above U+FFFF, as the host and the CLI write it
}

// Append `text` to `parent`, each flagged code point (offsets in code points, or `misread`) as a <mark>;
// `json`: write the rest as the inside of a JSON string literal. Returns how many were marked.
function appendFaithful(parent, text, offsets, json) {
  let run = "";
  let marked = 0;
  let i = 0;
  for (const ch of String(text)) {
    if ((offsets && offsets.has(i)) || misread(ch)) {
      if (run) parent.append(run);
      run = "";
      const mark = document.createElement("mark");
      mark.className = "cp";
      mark.textContent = marker(ch);
      mark.title = "U+" + ch.codePointAt(0).toString(16).toUpperCase().padStart(4, "0");
      parent.append(mark);
      marked++;
    } else {
      run += json ? JSON.stringify(ch).slice(1, -1) : ch;
    }
    i++;
  }
  if (run) parent.append(run);
  return marked;
}

function setFaithful(element, text) {
  element.replaceChildren();
  return appendFaithful(element, text, null, false);
}

// The JSON path of a child, exactly as the host writes it (display.child_path).
function childPath(path, step) {
  if (typeof step === "number") return `${path}[${step}]`;
  return /^[A-Za-z_][A-Za-z0-9_]*$/.test(step) ? `${path}.${step}` : `${path}[${JSON.stringify(step)}]`;
}

// Render a JSON value into `parent` (JSON.stringify's layout), strings isolated (bidi) and faithful.
// `found`: Map of "path" / "key:path" to a Set of offsets. Returns how many code points were marked.
function renderJson(parent, value, found, path = "$", indent = "") {
  const string = (text, offsets) => {
    const span = document.createElement("span");
    span.className = "s";
    span.append('"');
    const marked = appendFaithful(span, text, offsets, true);
    span.append('"');
    parent.append(span);
    return marked;
  };
  if (typeof value === "string") return string(value, found.get(path));
  if (value === null || typeof value !== "object") { parent.append(JSON.stringify(value)); return 0; }
  const entries = Array.isArray(value) ? value.map((v, i) => [i, v]) : Object.entries(value);
  const [open, close] = Array.isArray(value) ? ["[", "]"] : ["{", "}"];
  if (!entries.length) { parent.append(open + close); return 0; }
  let marked = 0;
  parent.append(open);
  entries.forEach(([step, child], n) => {
    const at = childPath(path, step);
    parent.append(`\n${indent}  `);
    if (typeof step === "string") { marked += string(step, found.get("key:" + at)); parent.append(": "); }
    marked += renderJson(parent, child, found, at, indent + "  ");
    if (n < entries.length - 1) parent.append(",");
  });
  parent.append(`\n${indent}${close}`);
  return marked;
}

async function displayFindings(view) {
  const artifact = (view.request.evidence || []).find((e) => e.kind === "display_findings");
  const found = new Map();
  if (!artifact || !view.evidence_payload) return found;
  const answer = await api("GET", artifact.uri);
  for (const f of answer.findings || []) {
    const at = (f.key ? "key:" : "") + f.path;
    if (!found.has(at)) found.set(at, new Set());
    found.get(at).add(f.index);
  }
  return found;
}

// ---------------------------------------------------------------- detail

async function select(approvalId) {
  state.selected = approvalId;
  if (state.runAbort) state.runAbort.abort();
  $("run").hidden = true;
  $("decide-error").textContent = "";
  $("reason").value = "";
  renderQueue();
  await refreshApproval(approvalId);
}

function renderDetail() {
  const view = state.approvals.get(state.selected);
  $("detail").hidden = !view;
  $("detail-empty").hidden = Boolean(view);
  if (!view) return;
  const request = view.request;
  let marked = setFaithful($("d-capability"), request.capability_id);
  marked += setFaithful($("d-action"), request.action_id);
  marked += setFaithful($("d-requester"), request.requester.id);
  $("d-risk").textContent = request.risk || "—";
  $("d-policy").textContent = request.policy_hash;
  $("d-left").textContent = view.status === "pending" ? timeLeft(request.expires_at) : "—";
  $("d-status").textContent = view.decision
    ? `${view.status} by ${view.decision.approver.id}${view.decision.reason ? ` (${view.decision.reason})` : ""}`
    : view.status;
  $("d-input").replaceChildren();
  if (view.evidence_payload) marked += renderJson($("d-input"), view.evidence_payload.input, view.found || new Map());
  else $("d-input").textContent = "(not shown to this principal)";
  $("d-warning").hidden = marked === 0;
  $("d-warning-count").textContent = String(marked);
  $("decide-form").hidden = view.status !== "pending";
}

async function decide(decision) {
  const view = state.approvals.get(state.selected);
  const reason = $("reason").value.trim();
  $("decide-error").textContent = "";
  if (!reason) { $("decide-error").textContent = "A decision needs a reason."; return; }
  for (const button of [$("approve"), $("deny")]) button.disabled = true;
  try {
    await api("POST", `${API}/approvals/${encodeURIComponent(view.request.id)}/decision`,
      { decision, reason, policy_hash: view.request.policy_hash });
    await refreshApproval(view.request.id);
    if (decision === "approved") watchRun(view.request.action_id);
  } catch (err) {
    $("decide-error").textContent = `${err.message}${err.code ? ` (${err.code})` : ""}`;
  } finally {
    for (const button of [$("approve"), $("deny")]) button.disabled = false;
  }
}

function watchRun(actionId) {
  if (state.runAbort) state.runAbort.abort();
  state.runAbort = new AbortController();
  $("run").hidden = false;
  $("run-chunks").textContent = "";
  $("run-result").textContent = "";
  $("run-status").textContent = "running";
  follow(`${API}/actions/${encodeURIComponent(actionId)}/events`, (name, data) => {
    let envelope = null;
    try { envelope = JSON.parse(data); } catch (_) { return undefined; }
    const body = envelope.body || {};
    if (body.stream_chunk && body.stream_chunk.part && body.stream_chunk.part.text) {
      appendFaithful($("run-chunks"), body.stream_chunk.part.text, null, false);
    } else if (body.action_result) {
      $("run-status").textContent = body.action_result.status;
      $("run-result").replaceChildren();
      renderJson($("run-result"), body.action_result.output ?? body.action_result.error ?? null, new Map());
      return "stop";
    } else if (body.error) {
      $("run-status").textContent = "failed";
    }
    return undefined;
  }, state.runAbort.signal).catch((err) => { $("run-status").textContent = `unreadable: ${err.message}`; });
}

// ---------------------------------------------------------------- sign-in

function showError(err) {
  console.error(err);
  if (err instanceof ApiError && err.status === 401) signOut("Signed out: the host refused the credential.");
}

async function signIn(auth) {
  state.auth = auth;
  await api("GET", `${API}/approvals?status=pending&limit=1`);  // the host checks the credential and the role
  $("who").textContent = auth.kind === "token" ? "signed in with a token" : `signed in as ${auth.keyId} (Ed25519)`;
  $("sign-in").hidden = true;
  $("workspace").hidden = false;
  $("sign-out").hidden = false;
  await loadPending();
  watchApprovals();
}

function signOut(message) {
  if (state.liveAbort) state.liveAbort.abort();
  if (state.runAbort) state.runAbort.abort();
  state.auth = null;
  state.approvals = new Map();
  state.selected = null;
  sessionStorage.removeItem("aip-crewai-token");
  keyStore("readwrite", (store) => store.delete("signing")).catch(() => undefined);
  $("workspace").hidden = true;
  $("sign-out").hidden = true;
  $("sign-in").hidden = false;
  $("who").textContent = "";
  $("live").textContent = "offline";
  $("live").className = "badge off";
  $("sign-in-error").textContent = message || "";
}

async function onSignIn(event) {
  event.preventDefault();
  $("sign-in-error").textContent = "";
  const method = new FormData(event.target).get("method");
  try {
    if (method === "token") {
      const token = $("token").value.trim();
      if (!token) throw new Error("enter a token");
      await signIn({ kind: "token", token });
      sessionStorage.setItem("aip-crewai-token", token);
    } else {
      const keyId = $("key-id").value.trim();
      if (!keyId) throw new Error("enter the key id (your principal id)");
      const key = await importKey($("key-pem").value);
      await signIn({ kind: "key", keyId, key });
      if ($("remember").checked) await keyStore("readwrite", (store) => store.put({ keyId, key }, "signing"));
    }
    $("token").value = "";
    $("key-pem").value = "";
  } catch (err) {
    state.auth = null;
    $("sign-in-error").textContent = err.message + (err.code ? ` (${err.code})` : "");
  }
}

async function restore() {
  const token = sessionStorage.getItem("aip-crewai-token");
  if (token) return signIn({ kind: "token", token });
  const saved = await keyStore("readonly", (store) => store.get("signing")).catch(() => null);
  if (saved && saved.key) return signIn({ kind: "key", keyId: saved.keyId, key: saved.key });
  return undefined;
}

document.addEventListener("DOMContentLoaded", () => {
  $("sign-in-form").addEventListener("submit", onSignIn);
  $("sign-in-form").addEventListener("change", () => {
    const key = new FormData($("sign-in-form")).get("method") === "key";
    $("key-fields").hidden = !key;
    $("token-fields").hidden = key;
  });
  $("decide-form").addEventListener("submit", (event) => {
    event.preventDefault();
    decide(event.submitter ? event.submitter.value : "approved");
  });
  $("sign-out").addEventListener("click", () => signOut());
  setInterval(() => { renderQueue(); if (state.selected) $("d-left").textContent = (() => {
    const view = state.approvals.get(state.selected);
    return view && view.status === "pending" ? timeLeft(view.request.expires_at) : "—";
  })(); }, 1000);
  restore().catch((err) => signOut(err.message));
});
