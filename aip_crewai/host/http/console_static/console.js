// aip-crewai approval console: a static page over the host's own AIP routes.
// It enforces nothing: the host authenticates every request and checks every decision.
// Sign-in: a bearer token (kept for this tab only) or an Ed25519 key read from a file picker and
// imported as a non-extractable WebCrypto key (optionally kept in IndexedDB; never shown) that signs
// every request with HTTP Message Signatures (RFC 9421). Live data: SSE read with fetch(), so the
// credential travels in headers and never in a URL; reconnects wait the server's `retry:` with jitter.
// Keyboard: every card is a button (Tab, Enter); Escape closes the detail and returns to its card.
// Each card and the detail show whether the approval's webhook notification went out (docs/webhooks.md
// "Notification state"): read once per approval, again on its approval events, and every NOTIFY_POLL_MS while
// a shown one is queued or retrying.
// docs/approvals.md "Approval console".
"use strict";

const API = "/aip/v1";
//: Reconnection time before the server sends `retry:` (ms), and the most a backoff waits (ms).
const DEFAULT_RETRY_MS = 3000;
const MAX_RETRY_MS = 30000;
//: Decided approvals read per page (the host's bound), and how many approvals' inputs load at once.
const PAGE = 200;
const PREVIEW_CHARS = 140;
//: How often a shown notification that is queued or retrying is read again (ms).
const NOTIFY_POLL_MS = 3000;
const state = {
  auth: null, approvals: new Map(), notifications: new Map(), notifying: new Set(), selected: null, view: "pending",
  runAbort: null, liveAbort: null, shown: null, decidedHere: null, listed: null,
  retryMs: DEFAULT_RETRY_MS, pendingLoaded: false, historyCursor: undefined, historyLoaded: false,
};
const $ = (id) => document.getElementById(id);
const utf8 = new TextEncoder();

// ---------------------------------------------------------------- credentials

function b64(bytes) {
  let text = "";
  for (const b of new Uint8Array(bytes)) text += String.fromCharCode(b);
  return btoa(text);
}

// The DER prefix of an Ed25519 PKCS#8 v1 key (RFC 8410): 16 bytes, then the 32-byte seed.
const ED25519_PKCS8 = [0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
const ED25519_OID = [0x06, 0x03, 0x2b, 0x65, 0x70];
const MAX_KEY_FILE_BYTES = 16384;

class KeyFileError extends Error {}

function holds(bytes, needle) {
  outer: for (let i = 0; i + needle.length <= bytes.length; i++) {
    for (let j = 0; j < needle.length; j++) if (bytes[i + j] !== needle[j]) continue outer;
    return true;
  }
  return false;
}

// The DER bytes of a PKCS#8 Ed25519 PEM, or a KeyFileError saying exactly what is wrong with the file.
function pemBody(pem) {
  const label = /-----BEGIN ([A-Z0-9 ]+)-----/.exec(pem);
  if (!label) throw new KeyFileError("the file is not a PEM key: no \"-----BEGIN PRIVATE KEY-----\" line");
  if (label[1] !== "PRIVATE KEY") {
    const what = {
      "OPENSSH PRIVATE KEY": "an OpenSSH key", "ENCRYPTED PRIVATE KEY": "an encrypted (password-protected) key",
      "PUBLIC KEY": "a public key", "RSA PRIVATE KEY": "an RSA key", "EC PRIVATE KEY": "an EC key",
    }[label[1]] || `a "${label[1]}" PEM`;
    throw new KeyFileError(`the file holds ${what}; the console needs an unencrypted PKCS#8 Ed25519 private key ` +
      "(BEGIN PRIVATE KEY), as aip-crewai keys generate ed25519 writes");
  }
  const match = /-----BEGIN PRIVATE KEY-----([\s\S]*?)-----END PRIVATE KEY-----/.exec(pem);
  if (!match) throw new KeyFileError("the PEM is cut short: no \"-----END PRIVATE KEY-----\" line");
  const text = match[1].replace(/\s+/g, "");
  const bad = /[^A-Za-z0-9+/=]/.exec(text);
  if (bad) throw new KeyFileError(`the PEM body is not base64: "${bad[0]}" at character ${bad.index + 1}`);
  let raw;
  try { raw = atob(text); } catch (_) {
    throw new KeyFileError(`the PEM body is not valid base64 (${text.length} characters: a line is missing or cut)`);
  }
  const der = Uint8Array.from(raw, (c) => c.charCodeAt(0));
  if (!holds(der, ED25519_OID)) throw new KeyFileError("the key is not an Ed25519 key (RSA, EC or another algorithm)");
  if (der.length < 48 || !ED25519_PKCS8.every((b, i) => der[i] === b)) {
    throw new KeyFileError(`the Ed25519 key is garbled: its DER is ${der.length} bytes, not the 48 of a PKCS#8 key`);
  }
  return der;
}

async function importKey(pem) {
  const der = pemBody(pem);
  if (!window.isSecureContext || !crypto.subtle) {
    throw new Error("this page is not a secure context (HTTPS or localhost), so the browser offers no WebCrypto " +
      "to sign with: open the console over HTTPS, or sign in with a token");
  }
  try {
    return await crypto.subtle.importKey("pkcs8", der, { name: "Ed25519" }, false, ["sign"]);
  } catch (err) {
    if (err && err.name === "NotSupportedError") {
      throw new Error("this browser does not support Ed25519 in WebCrypto (NotSupportedError): " +
        "use a current Chromium, Firefox or Safari, or sign in with a token");
    }
    throw new KeyFileError(`the Ed25519 key is garbled: WebCrypto refused it (${err && err.name || err})`);
  }
}

async function readKeyFile(input) {
  const file = input.files && input.files[0];
  if (!file) throw new KeyFileError("choose your private key file");
  if (file.size > MAX_KEY_FILE_BYTES) {
    throw new KeyFileError(`"${file.name}" is ${file.size} bytes: not a key file (at most ${MAX_KEY_FILE_BYTES})`);
  }
  return file.text();
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

// An answer that arrived for a session signed out (or replaced) since its request was sent: dropped before anything
// of it is kept or shown, so a late answer never puts a signed-out principal's approvals back in the page.
class Superseded extends Error {
  constructor() {
    super("an answer for a session signed out since its request was sent");
    console.debug(`aip-crewai console: ${this.message} was dropped`);
  }
}

function describe(err) {
  if (err instanceof ApiError) return `${err.message}${err.code ? ` (${err.code})` : ""}`;
  if (err instanceof TypeError) return `the host did not answer (${err.message})`;
  return err && err.message ? err.message : String(err);
}

// Raises Superseded when the session that sent the request is no longer the signed-in one (signOut, signIn).
async function api(method, path, payload, exact = false) {
  const auth = state.auth;
  const url = new URL(path, location.origin).href;
  const body = payload === undefined ? undefined : JSON.stringify(payload);
  const headers = { Accept: "application/aip+json, application/json", ...(await authHeaders(method, url, body)) };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let text, response;
  try {
    response = await fetch(url, { method, headers, body, cache: "no-store" });
    text = await response.text();
  } catch (err) {
    if (state.auth !== auth) throw new Superseded();
    throw err;
  }
  if (state.auth !== auth) throw new Superseded();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
  if (!response.ok) {
    const error = data && data.body && data.body.error && data.body.error.error;
    throw new ApiError(response.status, error);
  }
  return exact && data ? { data, exact: parseExact(text) } : data;
}

// ---------------------------------------------------------------- exact numbers
// JSON.parse reads every number as a double: 12345678901234567891 becomes 12345678901234567000, 1.0 becomes
// 1 and -0.0 becomes 0, while the crew runs the host's exact value. An input is therefore parsed keeping each
// number's source text (JSON.rawJSON, JSON.parse's reviver `context.source`: Chrome 114, Firefox 135,
// Safari 18.4), which renderJson and JSON.stringify write back verbatim. A browser without it gets
// `exactNumbers: false` and the console says that its numbers may read differently. docs/approvals.md.
const EXACT_NUMBERS = typeof JSON.rawJSON === "function" && typeof JSON.isRawJSON === "function"
  && JSON.parse("1.0", (key, value, context) => (context && context.source === "1.0" ? JSON.rawJSON("1.0") : value))
    .rawJSON === "1.0";

function parseExact(text) {
  if (!EXACT_NUMBERS) return null;
  return JSON.parse(text, (key, value, context) => (typeof value === "number" ? JSON.rawJSON(context.source) : value));
}

function isExactNumber(value) {
  return EXACT_NUMBERS && JSON.isRawJSON(value);
}

// Whether a value holds a number (a browser without exact numbers may show it otherwise than it runs).
function holdsNumber(value) {
  if (typeof value === "number" || isExactNumber(value)) return true;
  if (value === null || typeof value !== "object") return false;
  return Object.values(value).some(holdsNumber);
}

// How long to wait before reconnect `attempt` (0 first): the server's `retry` (ms) doubled per failed
// attempt, at most MAX_RETRY_MS, times a random factor in [1, 2) so consoles do not reconnect in lockstep.
function reconnectDelay(attempt, retryMs, random = Math.random) {
  return Math.round(Math.min(retryMs * 2 ** attempt, MAX_RETRY_MS) * (1 + random()));
}

// One SSE stream read with fetch (so requests carry headers); resumes with Last-Event-ID after
// reconnectDelay until the server ends it for good (204) or `signal` aborts. onEvent(name, data, id).
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
            else if (field === "retry" && /^\d+$/.test(text)) state.retryMs = Number(text);
          }
        }
      }
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof ApiError && err.status < 500) throw err;
    }
    if (onState) onState(false);
    await new Promise((resolve) => setTimeout(resolve, reconnectDelay(attempt, state.retryMs)));
  }
}

// ---------------------------------------------------------------- faithful display
// A code point a person would misread (a bidi control, an invisible, control or odd space character, a
// look-alike letter) is drawn as its \u202e-style marker, highlighted, never as itself. The host lists
// them per JSON path for an approval's input (GET .../display, aip_crewai/contracts/display.py: look-alike
// and mixed-script letters come only from that list); `misread` is the same character classes again, a
// safety net for text the host does not list (ids, chunks, results). docs/approvals.md "The approval flow".
const BIDI = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/u;
const BLANK = /[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2800\u3164\uffa0\ufe00-\ufe0f\u{e0100}-\u{e01ef}]/u;
const OTHER = /[\p{Cf}\p{Cc}\p{Cs}\p{Zs}\p{Zl}\p{Zp}]/u;
const MISREAD = new RegExp(`${BIDI.source}|${BLANK.source}|${OTHER.source}`, "u");
//: At most this many highlighted runs (<mark> elements) in one input or result: past them, each misread code point
//: is still written as its marker, without highlight, so an input of a million of them renders in one pass
//: with a bounded number of elements (docs/approvals.md "Approval console").
const MAX_MARKS = 2000;

function misread(ch) {
  if (ch === " " || ch === "\t" || ch === "\n" || ch === "\r") return false;
  return MISREAD.test(ch);
}

function marker(ch) {
  let out = "";
  for (let i = 0; i < ch.length; i++) out += "\\u" + ch.charCodeAt(i).toString(16).padStart(4, "0");
  return out;  // the JSON escape: a surrogate pair above U+FFFF, as the host and the CLI write it
}

// How many highlighted runs a rendering may still add (`marks`), and how many code points it wrote as markers
// without highlight once they were used up (`plain`).
function markBudget() {
  return { marks: MAX_MARKS, plain: 0, isolates: MAX_MARKS };
}

// A right-to-left letter or mark (the right-to-left blocks of Unicode: Hebrew, Arabic, Syriac, Thaana, N'Ko, ...),
// never a digit (Arabic-Indic ones included), punctuation or format character; a run of them joined by spaces and
// plain punctuation (no digit, bracket, quote or backslash).
const RTL_LETTER = String.raw`(?:(?=[\p{L}\p{M}])[\u0590-\u08ff\ufb1d-\ufdff\ufe70-\ufefe\u{10800}-\u{10fff}\u{1e800}-\u{1efff}])`;
const RTL_RUN = new RegExp(
  String.raw`${RTL_LETTER}(?:[ ,.;:!?'\-\u060c\u061b\u061f\u06d4\u05be\u05c0\u05c3\u05f3\u05f4]*${RTL_LETTER})*`, "gu");

// Append plain `text` to `parent`, each run of right-to-left letters in a right-to-left isolate of its own (<bdi>):
// the words read right to left as they must, but no digit, key or letter outside moves. A JSON string (.s, CSS)
// shows everything else left to right in the order it is stored, so a right-to-left letter can never swap the
// digit groups after it ("שלום 3456 7890" shows "3456 7890", not "7890 3456"). At most `budget.isolates` runs
// get one; past them a run shows letter by letter left to right (still in stored order).
function appendText(parent, text, budget) {
  let at = 0;
  for (const match of text.matchAll(RTL_RUN)) {
    if (!(budget.isolates > 0)) break;
    budget.isolates--;
    if (match.index > at) parent.append(text.slice(at, match.index));
    const run = document.createElement("bdi");
    run.dir = "rtl";
    run.textContent = match[0];
    parent.append(run);
    at = match.index + match[0].length;
  }
  if (at < text.length) parent.append(at ? text.slice(at) : text);
}

// The title of a highlighted run: its code points (U+200B), each repeated one's count, at most eight named.
function runTitle(counts) {
  const named = [...counts].slice(0, 8).map(([cp, n]) => `U+${cp.toString(16).toUpperCase().padStart(4, "0")}` +
    (n > 1 ? ` ×${n}` : ""));
  return named.join(" ") + (counts.size > 8 ? " …" : "");
}

// Append `text` to `parent`, each flagged code point (offsets in code points, or `misread`) as its marker;
// `json`: write the rest as the inside of a JSON string literal. Consecutive flagged code points share one
// highlighted <mark>, and once `budget` has no runs left the markers are written without highlight: the work is
// one pass over the text and the elements stay bounded. Returns how many code points were flagged.
function appendFaithful(parent, text, offsets, json, budget = { marks: Infinity, plain: 0, isolates: Infinity }) {
  const escape = (raw) => (json && raw ? JSON.stringify(raw).slice(1, -1) : raw);
  let done = "";    // written text not appended yet (escaped, markers without highlight included)
  let raw = "";     // unflagged code points after `done`, not escaped yet
  let run = null;   // the open highlighted run: { markers, counts }
  let marked = 0;
  let i = 0;
  const closeRun = () => {
    const mark = document.createElement("mark");
    mark.className = "cp";
    mark.textContent = run.markers;
    mark.title = runTitle(run.counts);
    parent.append(mark);
    run = null;
  };
  for (const ch of String(text)) {
    if ((offsets && offsets.has(i)) || misread(ch)) {
      marked++;
      if (!run && budget.marks > 0) {
        done += escape(raw);
        raw = "";
        if (done) appendText(parent, done, budget);
        done = "";
        budget.marks--;
        run = { markers: "", counts: new Map() };
      }
      if (run) {
        const cp = ch.codePointAt(0);
        run.markers += marker(ch);
        run.counts.set(cp, (run.counts.get(cp) || 0) + 1);
      } else {
        done += escape(raw) + marker(ch);
        raw = "";
        budget.plain++;
      }
    } else {
      if (run) closeRun();
      raw += ch;
    }
    i++;
  }
  if (run) closeRun();
  done += escape(raw);
  if (done) appendText(parent, done, budget);
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
// `found`: Map of "path" / "key:path" to a Set of offsets; `budget`: the highlighted runs left (markBudget).
// Returns how many code points were marked.
function renderJson(parent, value, found, budget = markBudget(), path = "$", indent = "") {
  const string = (text, offsets) => {
    const span = document.createElement("span");
    span.className = "s";
    span.append('"');
    const marked = appendFaithful(span, text, offsets, true, budget);
    span.append('"');
    parent.append(span);
    return marked;
  };
  if (typeof value === "string") return string(value, found.get(path));
  if (isExactNumber(value)) { parent.append(value.rawJSON); return 0; }
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
    marked += renderJson(parent, child, found, budget, at, indent + "  ");
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
  found.truncated = answer.truncated === true;  // the host listed only its first MAX_FINDINGS: others are unmarked
  return found;
}

// ---------------------------------------------------------------- cards: the queue and the history

function timeLeft(expiresAt) {
  const ms = Date.parse(expiresAt) - Date.now();
  if (ms <= 0) return "expired";
  const s = Math.floor(ms / 1000);
  return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
}

function when(rfc3339) {
  const at = new Date(rfc3339);
  return Number.isNaN(at.getTime()) ? rfc3339 : at.toLocaleString();
}

function span(className, text, faithful = true) {
  const element = document.createElement("span");
  if (className) element.className = className;
  if (faithful) setFaithful(element, text); else element.textContent = text;
  return element;
}

// A compact JSON text split into its string literals (the last one perhaps cut short) and what lies between.
const JSON_PIECES = /"(?:[^"\\]|\\.)*"?|[^"]+/gsu;

// The first PREVIEW_CHARS code points of the input's compact JSON, each misread code point as its marker and
// each string isolated (bidi), as in the detail: a right-to-left letter never reorders the keys and numbers after it.
function preview(view) {
  const element = span("preview", "", false);
  if (!view.evidence_payload) { element.textContent = view.previewError || "input loading…"; return element; }
  const text = JSON.stringify(view.evidence_payload.input);
  const head = firstPoints(text, PREVIEW_CHARS);
  for (const piece of head.match(JSON_PIECES) || []) {
    if (!piece.startsWith('"')) { appendFaithful(element, piece, null, false); continue; }
    const literal = span("s", "", false);
    appendFaithful(literal, piece, null, false);
    element.append(literal);
  }
  if (head.length < text.length) element.append("…");
  return element;
}

// The first `n` code points of `text` (a surrogate pair is one), read no further: a 1 MiB input costs no more.
function firstPoints(text, n) {
  let end = 0;
  for (let k = 0; k < n && end < text.length; k++) end += text.codePointAt(end) > 0xffff ? 2 : 1;
  return text.slice(0, end);
}

function card(view) {
  const request = view.request;
  const button = document.createElement("button");
  button.type = "button";
  button.className = "card";
  button.dataset.approvalId = request.id;
  button.setAttribute("aria-current", String(state.selected === request.id));
  const risk = span(`risk ${request.risk || ""}`, `risk: ${request.risk || "unknown"}`, false);
  const first = span("line", "", false);
  first.append(span("", `action ${request.action_id}`), risk);
  const second = span("line", "", false);
  second.append(span("", `by ${request.requester.id}`));
  if (view.status === "pending") {  // not in the card's accessible name: it would change every second
    const left = span("left", `${timeLeft(request.expires_at)} left`, false);
    left.setAttribute("aria-hidden", "true");
    second.append(left);
  }
  else {
    const by = view.decision ? ` by ${view.decision.approver.id}` : "";
    second.append(span("", `${view.status}${by} · ${when(view.updated_at)}`));
  }
  button.append(span("cap", request.capability_id), first, second, span("line notify", notificationText(request.id), false),
    preview(view));
  if (view.found && view.found.size) button.append(span("flag", "⚠ input holds characters that read differently", false));
  button.addEventListener("click", () => select(request.id, button));
  const item = document.createElement("li");
  item.append(button);
  return item;
}

// ---------------------------------------------------------------- webhook notifications

// One notification (GET .../notifications) in words: its state, with when or how often.
function notificationPart(n) {
  if (n.state === "delivered") return `delivered ${when(n.delivered_at)}`;
  if (n.state === "retrying") {
    return `retrying (${n.attempts} attempt${n.attempts === 1 ? "" : "s"} failed${n.last_outcome ? `: ${n.last_outcome}` : ""}; ` +
      `next try ${when(n.next_attempt_at)})`;
  }
  if (n.state === "expired") return `expired ${when(n.expired_at)} (not delivered)`;
  return "queued";
}

// The notification state of an approval in words ("" prefix in the detail, whose row is labelled).
function notificationText(approvalId, prefix = "notification: ") {
  const answer = state.notifications.get(approvalId);
  if (!answer) return `${prefix}…`;
  if (answer.error) return `${prefix}unknown (${answer.error})`;
  if (answer.state === "none") return `${prefix}none configured`;
  return prefix + answer.notifications.map(notificationPart).join(" · ");
}

function showNotification(approvalId) {
  const text = notificationText(approvalId);
  for (const line of document.querySelectorAll(`.card[data-approval-id="${CSS.escape(approvalId)}"] .notify`)) {
    line.textContent = text;
  }
  if (state.selected === approvalId) $("d-notify").textContent = notificationText(approvalId, "");
}

async function refreshNotification(approvalId) {
  if (state.notifying.has(approvalId)) return;
  state.notifying.add(approvalId);
  try {
    state.notifications.set(approvalId, await api("GET", `${API}/approvals/${encodeURIComponent(approvalId)}/notifications`));
  } catch (err) {
    if ((err instanceof ApiError && err.status === 401) || err instanceof Superseded) throw err;
    state.notifications.set(approvalId, { error: describe(err) });
  } finally {
    state.notifying.delete(approvalId);
  }
  showNotification(approvalId);
}

// Read the notifications of `ids` (four at a time): those not read yet, or (`unsettled`) queued or retrying.
async function loadNotifications(ids, unsettled) {
  const todo = ids.filter((id) => {
    const known = state.notifications.get(id);
    return !known || (unsettled && (known.error || known.state === "queued" || known.state === "retrying"));
  });
  const auth = state.auth;  // a session signed out meanwhile reads no more (nor with the next one's credential)
  const worker = async () => {
    for (let id = todo.shift(); id && state.auth === auth; id = todo.shift()) await refreshNotification(id);
  };
  await Promise.all([worker(), worker(), worker(), worker()]);
}

// The approvals whose cards the current view shows, and the open one.
function shownIds() {
  const list = state.view === "pending" ? $("queue") : $("history");
  const ids = [...list.querySelectorAll(".card")].map((card) => card.dataset.approvalId);
  if (state.selected && !ids.includes(state.selected)) ids.push(state.selected);
  return ids;
}

function pollNotifications() {
  if (!state.auth || $("workspace").hidden) return;
  loadNotifications(shownIds(), true).catch(showError);
}

// Replace a list's cards, keeping the keyboard focus on the same approval's card.
function renderCards(list, views) {
  const focused = document.activeElement && document.activeElement.closest && document.activeElement.closest(".card");
  const focusedId = focused && list.contains(focused) ? focused.dataset.approvalId : null;
  list.replaceChildren(...views.map(card));
  if (state.auth && !list.closest("[hidden]")) loadNotifications(views.map((v) => v.request.id), false).catch(showError);
  if (focusedId) {  // never move the focus silently to another approval: Enter would then open that one
    const again = list.querySelector(`.card[data-approval-id="${CSS.escape(focusedId)}"]`);
    if (again) again.focus();
    else {
      $(list.getAttribute("aria-labelledby")).focus();
      announce("The approval you were on left this list (decided, withdrawn or expired).");
    }
  }
}

// Say `text` in the polite live region (a screen reader reads it; the page shows it under the lists). What is
// said in one turn of the page is said together ("The approval you were on left this list. 1 new approval ...").
let saying = null;
function announce(text) {
  if (text && saying) saying.push(text);
  else {
    saying = text ? [text] : null;
    if (saying) queueMicrotask(() => { saying = null; });
  }
  $("announce").textContent = saying ? saying.join(" ") : "";
}

function pendingViews() {
  return [...state.approvals.values()].filter((a) => a.status === "pending")
    .sort((a, b) => a.created_at.localeCompare(b.created_at));
}

function renderQueue() {
  const pending = pendingViews();
  renderCards($("queue"), pending);
  $("count").textContent = state.pendingLoaded ? `(${pending.length})` : "";
  $("queue-state").textContent = !state.pendingLoaded ? ($("queue-error").hidden ? "Loading the queue…" : "")
    : pending.length ? "" : "Nothing waits for a decision.";
  announceArrivals(pending);
}

// Approvals that join the pending queue after its first load (a live event, or the reload after a reconnect) are
// said once in the live region, "1 new approval waiting": a render that brings none, or only ones already
// listed, says nothing. `state.listed` is every approval id the queue has listed since sign-in.
function announceArrivals(pending) {
  if (!state.pendingLoaded) return;
  const first = state.listed === null;
  if (first) state.listed = new Set();
  const fresh = pending.filter((view) => !state.listed.has(view.request.id));
  for (const view of fresh) state.listed.add(view.request.id);
  if (first || !fresh.length) return;
  const n = fresh.length;
  announce(`${n} new approval${n === 1 ? "" : "s"} waiting (${pending.length} pending).`);
}

function filtersOf() {
  return {
    action: $("f-action").value.trim().toLowerCase(), state: $("f-state").value,
    capability: $("f-capability").value, requester: $("f-requester").value,
  };
}

function fillSelect(select, values) {
  const chosen = select.value;
  const options = [...new Set(values)].sort().map((value) => {
    const option = document.createElement("option");
    option.value = value;
    setFaithful(option, value);
    option.textContent = option.textContent || value;
    return option;
  });
  const any = document.createElement("option");
  any.value = "";
  any.textContent = "any";
  select.replaceChildren(any, ...options);
  select.value = values.includes(chosen) ? chosen : "";
}

function renderHistory() {
  const decided = [...state.approvals.values()].filter((a) => a.status !== "pending")
    .sort((a, b) => b.updated_at.localeCompare(a.updated_at));
  fillSelect($("f-capability"), decided.map((a) => a.request.capability_id));
  fillSelect($("f-requester"), decided.map((a) => a.request.requester.id));
  const f = filtersOf();
  const shown = decided.filter((a) => (!f.action || a.request.action_id.toLowerCase().includes(f.action))
    && (!f.state || a.status === f.state) && (!f.capability || a.request.capability_id === f.capability)
    && (!f.requester || a.request.requester.id === f.requester));
  renderCards($("history"), shown);
  $("history-more").hidden = !state.historyCursor;
  $("history-state").textContent = !state.historyLoaded ? ($("history-error").hidden ? "Loading the history…" : "")
    : !decided.length ? "No approval has been decided yet."
    : !shown.length ? "No decided approval matches the filters." : `${shown.length} of ${decided.length} shown.`;
}

function renderLists() {
  renderQueue();
  renderHistory();
}

// The approval with its input (and display findings): for the detail and the card's preview.
async function refreshApproval(approvalId) {
  const auth = state.auth;
  try {
    const answer = await api("GET", `${API}/approvals/${encodeURIComponent(approvalId)}`, undefined, true);
    const view = answer.data;
    if (view.evidence_payload) {  // the input as it runs: numbers exact where the browser can (parseExact)
      const exact = answer.exact && answer.exact.evidence_payload;
      view.evidence_payload.input = exact ? exact.input : view.evidence_payload.input;
      view.exactNumbers = Boolean(exact);
    } else view.previewError = "no input: the host sends the input to approvers only";  // never "loading…" for good
    view.found = await displayFindings(view);
    if (state.auth !== auth) throw new Superseded();
    state.approvals.set(approvalId, view);
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) state.approvals.delete(approvalId);
    else throw err;
  }
  renderLists();
  if (state.selected === approvalId) renderDetail();
}

// Read the inputs of listed approvals that lack one, four at a time (the cards' previews).
async function loadInputs(views) {
  const todo = views.filter((v) => !v.evidence_payload).map((v) => v.request.id);
  const auth = state.auth;  // a session signed out meanwhile reads no more (nor with the next one's credential)
  const worker = async () => {
    for (let id = todo.shift(); id && state.auth === auth; id = todo.shift()) {
      await refreshApproval(id).catch((err) => {
        if (err instanceof Superseded) return;
        const view = state.approvals.get(id);
        if (view) view.previewError = `input unreadable: ${describe(err)}`;
      });
    }
  };
  await Promise.all([worker(), worker(), worker(), worker()]);
  renderLists();
}

function keepInput(view) {
  const known = state.approvals.get(view.request.id);
  if (known && known.evidence_payload && !view.evidence_payload) {
    view.evidence_payload = known.evidence_payload;
    view.found = known.found;
    view.exactNumbers = known.exactNumbers;
    view.request.reason = known.request.reason;  // the approval's own read names what the crew may change
  }
  return view;
}

async function loadPending() {
  let cursor = null;
  const seen = new Map();
  $("queue-error").hidden = true;
  try {
    do {
      const query = new URLSearchParams({ status: "pending", limit: String(PAGE) });
      if (cursor) query.set("cursor", cursor);
      const page = await api("GET", `${API}/approvals?${query}`);
      for (const view of page.approvals) seen.set(view.request.id, keepInput(view));
      cursor = page.cursor;
    } while (cursor);
  } catch (err) {
    if (err instanceof Superseded) throw err;
    $("queue-error-text").textContent = `The queue could not be loaded: ${describe(err)}.`;
    $("queue-error").hidden = false;
    $("queue-state").textContent = "";
    throw err;
  }
  for (const [id, view] of state.approvals) if (view.status !== "pending" && !seen.has(id)) seen.set(id, view);
  state.approvals = seen;
  state.pendingLoaded = true;
  renderLists();
  await loadInputs(pendingViews());
}

// One page of decided approvals, newest first (GET /aip/v1/approvals?status=decided&order=newest).
async function loadHistory(more) {
  $("history-error").hidden = true;
  const query = new URLSearchParams({ status: "decided", order: "newest", limit: String(PAGE) });
  if (more && state.historyCursor) query.set("cursor", state.historyCursor);
  try {
    const page = await api("GET", `${API}/approvals?${query}`);
    for (const view of page.approvals) state.approvals.set(view.request.id, keepInput(view));
    state.historyCursor = page.cursor || null;
    state.historyLoaded = true;
  } catch (err) {
    if (err instanceof Superseded) return;
    $("history-error-text").textContent = `The history could not be loaded: ${describe(err)}.`;
    $("history-error").hidden = false;
    $("history-state").textContent = "";
    return;
  }
  renderHistory();
}

function showView(name) {
  state.view = name;
  $("view-pending").setAttribute("aria-pressed", String(name === "pending"));
  $("view-decided").setAttribute("aria-pressed", String(name === "decided"));
  $("pending-view").hidden = name !== "pending";
  $("decided-view").hidden = name !== "decided";
  if (name === "decided" && !state.historyLoaded) loadHistory(false).catch(showError);
}

// An approval event's data is an AIP Event whose `data` is the ApprovalRecordView (docs/approvals.md "Approval events");
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
    if (id) refreshNotification(id).catch(showError);
    if (id && name !== "pending") refreshApproval(id).catch(showError);
    else if (id && state.pendingLoaded && !state.approvals.has(id)) refreshApproval(id).catch(showError);
    else if (name === "ready") loadPending().catch(showError);
  }, state.liveAbort.signal, live)
    .catch((err) => { $("live").textContent = "no live events"; showError(err); });
}

// ---------------------------------------------------------------- detail

let returnFocus = null;

async function select(approvalId, from) {
  state.selected = approvalId;
  returnFocus = from ? from.dataset.approvalId : null;
  if (state.runAbort) state.runAbort.abort();
  $("run").hidden = true;
  $("decide-error").textContent = "";
  $("decided-note").textContent = "";
  $("reason").value = "";
  renderLists();
  renderDetail();
  $("d-capability").focus();
  $("detail").scrollIntoView({ block: "nearest" });
  await refreshApproval(approvalId).catch(showError);
}

// Escape: close the detail and put the focus back on its card (or the list).
function closeDetail() {
  const id = returnFocus || state.selected;
  state.selected = null;
  if (state.runAbort) state.runAbort.abort();
  renderLists();
  renderDetail();
  const list = state.view === "pending" ? $("queue") : $("history");
  const target = (id && list.querySelector(`.card[data-approval-id="${CSS.escape(id)}"]`)) || list.querySelector(".card")
    || $(state.view === "pending" ? "view-pending" : "view-decided");
  target.focus();
}

//: The detail's fields that name or show an approval (emptied when none is open).
const DETAIL_FIELDS = ["d-capability", "d-action", "d-approval", "d-requester", "d-why", "d-risk", "d-policy",
  "d-left", "d-status", "d-notify", "d-input"];

function renderDetail() {
  const view = state.approvals.get(state.selected);
  $("detail").hidden = !view;
  $("detail-empty").hidden = Boolean(view);
  if (!view) {  // nothing of it stays in the page
    for (const id of DETAIL_FIELDS) $(id).replaceChildren();
    $("reason").value = "";
    return;
  }
  const request = view.request;
  let marked = setFaithful($("d-capability"), request.capability_id);
  marked += setFaithful($("d-action"), request.action_id);
  marked += setFaithful($("d-approval"), request.id);
  marked += setFaithful($("d-requester"), request.requester.id);
  // The host's reason: on the approval's own read it also says what the crew's code may do to the inputs (not
  // counted in the input's warning: its names are the crew's, escaped by the host).
  setFaithful($("d-why"), request.reason || "—");
  $("d-risk").textContent = request.risk || "—";
  $("d-policy").textContent = request.policy_hash;
  $("d-left").textContent = view.status === "pending" ? timeLeft(request.expires_at) : "—";
  $("d-notify").textContent = notificationText(request.id, "");
  $("d-status").replaceChildren();
  if (view.decision) {
    appendFaithful($("d-status"), `${view.status} by ${view.decision.approver.id} at ${when(view.decision.decided_at)}` +
      `${view.decision.reason ? ` (${view.decision.reason})` : ""}`, null, false);
  } else $("d-status").textContent = view.status;
  $("d-input").replaceChildren();
  const found = view.found || new Map();
  const budget = markBudget();
  if (view.evidence_payload) marked += renderJson($("d-input"), view.evidence_payload.input, found, budget);
  else $("d-input").textContent = view.previewError || "loading…";
  $("d-warning").hidden = marked === 0;
  $("d-warning-count").textContent = `${found.truncated ? "at least " : ""}${marked}`;
  $("d-truncated").hidden = !found.truncated;
  $("d-plain").hidden = budget.plain === 0;
  $("d-plain-runs").textContent = MAX_MARKS.toLocaleString("en");
  $("d-plain-count").textContent = budget.plain.toLocaleString("en");
  $("d-numbers").hidden = !view.evidence_payload || view.exactNumbers || !holdsNumber(view.evidence_payload.input);
  const formHadFocus = $("decide-form").contains(document.activeElement);
  $("decide-form").hidden = view.status !== "pending";
  if (state.shown && state.shown.id === request.id && state.shown.status === "pending" && view.status !== "pending"
      && state.decidedHere !== request.id) {
    $("decided-note").textContent = endedElsewhere(view);
    if (formHadFocus) $("d-capability").focus();  // the form it was in is hidden: the focus stays on this approval
  }
  state.shown = { id: request.id, status: view.status };
  $("approve").disabled = !inputShown(view);
  $("approve-hint").hidden = inputShown(view);
}

// Why the open approval can no longer be decided, when that happened while it was open.
function endedElsewhere(view) {
  if (view.status === "withdrawn") return "This approval was withdrawn: the tenant cancelled the action.";
  if (view.status === "expired") return "This approval expired before a decision.";
  const by = view.decision ? ` by ${view.decision.approver.id}` : "";
  return `This approval was ${view.status}${by} meanwhile.`;
}

// Approving needs the input on screen: what the approver reads is what runs (docs/approvals.md).
function inputShown(view) {
  return Boolean(view && view.evidence_payload);
}

async function decide(decision) {
  const auth = state.auth;
  const view = state.approvals.get(state.selected);
  const reason = $("reason").value.trim();
  $("decide-error").textContent = "";
  if (!reason) { $("decide-error").textContent = "A decision needs a reason."; $("reason").focus(); return; }
  if (decision === "approved" && !inputShown(view)) {
    $("decide-error").textContent = "The input is not shown yet: approve once you have read it.";
    return;
  }
  for (const button of [$("approve"), $("deny")]) button.disabled = true;
  try {
    await api("POST", `${API}/approvals/${encodeURIComponent(view.request.id)}/decision`,
      { decision, reason, policy_hash: view.request.policy_hash });
  } catch (err) {
    if (err instanceof Superseded) return;  // signed out meanwhile (the host may still have taken the decision)
    $("decide-error").textContent = describe(err);
    $("deny").disabled = false;
    $("approve").disabled = !inputShown(state.approvals.get(state.selected));
    return;
  }
  state.decidedHere = view.request.id;  // renderDetail announces only decisions made elsewhere
  const done = `${decision === "approved" ? "Approved" : "Denied"} ${view.request.action_id}.`;
  $("decided-note").textContent = done;
  await refreshApproval(view.request.id).catch((err) => {  // the decision stands; only the view is stale
    if (!(err instanceof Superseded)) $("decided-note").textContent = `${done} The approval could not be read again: ${describe(err)}.`;
  });
  if (state.auth !== auth) return;  // signed out meanwhile: no run to follow
  $("deny").disabled = false;
  $("approve").disabled = !inputShown(state.approvals.get(state.selected));
  $("d-capability").focus();
  if (decision === "approved") watchRun(view.request.action_id);
}

function watchRun(actionId) {
  if (state.runAbort) state.runAbort.abort();
  state.runAbort = new AbortController();
  $("run").hidden = false;
  $("run-chunks").textContent = "";
  $("run-result").textContent = "";
  $("run-plain").hidden = true;
  $("run-numbers").hidden = true;
  $("run-status").textContent = "running";
  const chunkBudget = markBudget();  // the streamed output's highlighted runs, bounded as an input's
  follow(`${API}/actions/${encodeURIComponent(actionId)}/events`, (name, data) => {
    let envelope = null;
    let exact = false;
    try {  // the result's numbers as sent, as the input's (parseExact); plain JSON.parse where the browser cannot
      envelope = parseExact(data);
      exact = envelope !== null;
      if (!exact) envelope = JSON.parse(data);
    } catch (_) { return undefined; }
    const body = (envelope && envelope.body) || {};
    if (body.stream_chunk && body.stream_chunk.part && body.stream_chunk.part.text) {
      appendFaithful($("run-chunks"), body.stream_chunk.part.text, null, false, chunkBudget);
    } else if (body.action_result) {
      const result = body.action_result.output ?? body.action_result.error ?? null;
      const budget = markBudget();
      $("run-status").textContent = body.action_result.status;
      $("run-result").replaceChildren();
      renderJson($("run-result"), result, new Map(), budget);
      $("run-plain").hidden = budget.plain === 0;
      $("run-plain-count").textContent = budget.plain.toLocaleString("en");
      $("run-numbers").hidden = exact || !holdsNumber(result);
      return "stop";
    } else if (body.error) {
      $("run-status").textContent = "failed";
    }
    return undefined;
  }, state.runAbort.signal).catch((err) => { $("run-status").textContent = `unreadable: ${err.message}`; });
}

// ---------------------------------------------------------------- sign-in

function showError(err) {
  if (err instanceof Superseded) return;  // its session is gone: nothing to show or to sign out of
  console.error(err);
  if (err instanceof ApiError && err.status === 401) signOut("Signed out: the host refused the credential.");
}

//: The display findings of an approval id that no approval has: the sign-in's approver check (signIn).
const APPROVER_CHECK = `${API}/approvals/apr_console-approver-check/display`;

// A credential the host accepts for a principal that may not decide approvals (an operator, an invoker).
class NotAnApprover extends Error {
  constructor(err) {
    super(`This principal may not decide approvals: the host answered ${err.status}${err.code ? ` ${err.code}` : ""} ` +
      `("${err.message}"). The console is for approvers: sign in with an approver's token or key.`);
  }
}

// The host checks the credential and the role. Listing approvals needs the approver or operator role; an operator
// reads no input and decides nothing, so the display findings of an approval that does not exist tell them apart:
// 404 approval.not_found for an approver, 403 policy.forbidden for anyone else (the host checks the role before it
// looks the approval up, tests/host/test_display_findings.py).
async function signIn(auth) {
  state.auth = auth;
  try {
    await api("GET", `${API}/approvals?status=pending&limit=1`);
    await api("GET", APPROVER_CHECK).catch((err) => { if (!(err instanceof ApiError && err.status === 404)) throw err; });
  } catch (err) {
    if (err instanceof ApiError && err.status === 403) throw new NotAnApprover(err);
    throw err;
  }
  $("who").textContent = auth.kind === "token" ? "signed in with a token" : `signed in as ${auth.keyId} (Ed25519)`;
  $("sign-in").hidden = true;
  $("workspace").hidden = false;
  $("sign-out").hidden = false;
  showView("pending");
  renderLists();
  $("view-pending").focus();
  watchApprovals();
  await loadPending().catch(showError);
}

function signOut(message) {
  if (state.liveAbort) state.liveAbort.abort();
  if (state.runAbort) state.runAbort.abort();
  Object.assign(state, { auth: null, approvals: new Map(), notifications: new Map(), notifying: new Set(), selected: null,
    pendingLoaded: false,
    historyLoaded: false, historyCursor: undefined, shown: null, decidedHere: null, listed: null });
  announce("");
  sessionStorage.removeItem("aip-crewai-token");
  keyStore("readwrite", (store) => store.delete("signing")).catch(() => undefined);
  $("workspace").hidden = true;
  $("sign-out").hidden = true;
  $("sign-in").hidden = false;
  $("who").textContent = "";
  $("live").textContent = "offline";
  $("live").className = "badge off";
  $("sign-in-error").textContent = message || "";
  renderLists();  // the counts and cards of the signed-out principal go too
  renderDetail();
  // the decision form, its notes and the run the last decision followed (its chunks repeat the input)
  $("approve").disabled = true;
  $("deny").disabled = false;
  for (const id of ["decide-error", "decided-note", "run-chunks", "run-status"]) $(id).textContent = "";
  $("run-result").replaceChildren();
  $("run").hidden = true;
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
      let key;
      try {
        key = await importKey(await readKeyFile($("key-file")));
      } catch (err) {
        if (err instanceof KeyFileError) throw new Error(`The key file cannot be used: ${err.message}.`);
        throw err;
      }
      await signIn({ kind: "key", keyId, key });
      if ($("remember").checked) await keyStore("readwrite", (store) => store.put({ keyId, key }, "signing"));
    }
    $("token").value = "";
    $("key-file").value = "";
  } catch (err) {
    if (err instanceof Superseded) return;  // another sign-in (or a sign-out) replaced this one meanwhile
    state.auth = null;
    $("sign-in-error").textContent = describe(err);
    refocusSignIn();
  }
}

// After a refused sign-in: the focus on the credential's first field (described by the error), to try another.
function refocusSignIn() {
  const field = $(new FormData($("sign-in-form")).get("method") === "key" ? "key-id" : "token");
  field.focus();
  if (field.select) field.select();
}

async function restore() {
  const token = sessionStorage.getItem("aip-crewai-token");
  if (token) return signIn({ kind: "token", token });
  const saved = await keyStore("readonly", (store) => store.get("signing")).catch(() => null);
  if (saved && saved.key) return signIn({ kind: "key", keyId: saved.keyId, key: saved.key });
  return undefined;
}

function tick() {
  for (const left of document.querySelectorAll("#queue .card")) {
    const view = state.approvals.get(left.dataset.approvalId);
    const text = left.querySelector(".left");
    if (view && text) text.textContent = `${timeLeft(view.request.expires_at)} left`;
  }
  const view = state.selected && state.approvals.get(state.selected);
  if (view) $("d-left").textContent = view.status === "pending" ? timeLeft(view.request.expires_at) : "—";
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
  $("close").addEventListener("click", closeDetail);
  $("view-pending").addEventListener("click", () => showView("pending"));
  $("view-decided").addEventListener("click", () => showView("decided"));
  $("queue-retry").addEventListener("click", () => loadPending().catch(showError));
  $("history-retry").addEventListener("click", () => loadHistory(false));
  $("history-more").addEventListener("click", () => loadHistory(true));
  $("filters").addEventListener("input", renderHistory);
  $("filters").addEventListener("submit", (event) => event.preventDefault());  // Enter in the search box
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Escape" || !state.selected || event.defaultPrevented) return;
    if (event.target.matches && event.target.matches("input[type=search]")) return;  // Escape clears a search box
    event.preventDefault();
    closeDetail();
  });
  setInterval(tick, 1000);
  setInterval(pollNotifications, NOTIFY_POLL_MS);
  restore().catch((err) => {
    if (err instanceof Superseded) return;  // signed in by hand (or out) while the saved credential was checked
    signOut(describe(err));
    refocusSignIn();
  });
});
