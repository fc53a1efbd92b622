// gateway/playground.html's inline script against a tiny DOM stand-in and a scripted fetch:
// the key changes while the previous key's /v1/models body is still on its way; the route
// list must be the new key's. Exit status 1 if not. Usage: node playground_race.mjs PAGE
import fs from "node:fs";
const html = fs.readFileSync(process.argv[2], "utf8");
const script = html.match(/<script>([\s\S]*?)<\/script>/)[1];

const els = {};
class El {
  constructor(id) { this.id = id; this.value = ""; this.textContent = ""; this.dataset = {}; this.children = []; this.listeners = {}; this.disabled = false; }
  addEventListener(t, f) { (this.listeners[t] ||= []).push(f); }
  fire(t, e = {}) { for (const f of this.listeners[t] || []) f({ preventDefault() {}, ...e }); }
  replaceChildren(...c) { this.children = c; if (!c.some((o) => o.value === this.value)) this.value = c[0]?.value ?? ""; }
  append(t) { this.textContent += t; }
  setAttribute() {}
  requestSubmit() { this.fire("submit"); }
}
globalThis.document = { getElementById: (id) => (els[id] ||= new El(id)) };
globalThis.Option = class { constructor(text, value) { this.text = text; this.value = value; this.dataset = {}; } };
const store = new Map([["gateway.playground.key", "sk-old"]]);
globalThis.sessionStorage = { getItem: (k) => store.get(k) ?? null, setItem: (k, v) => store.set(k, v) };

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const models = (ids) => ({ object: "list", data: ids.map((id) => ({ id, kind: "adapter", aliases: [] })) });
globalThis.fetch = async (url, init) => {
  const key = init.headers.Authorization.slice(7);
  if (key === "sk-old") {  // headers arrive at once, the body is slow (a congested link)
    return { ok: true, status: 200, json: async () => { await sleep(800); return models(["old-key-route"]); } };
  }
  return { ok: true, status: 200, json: async () => models(["new-key-route"]) };
};

new Function(script)();               // page load: loads routes for the stored key sk-old
await sleep(10);
const key = document.getElementById("api-key");
key.value = "sk-new"; key.fire("input"); // the user replaces the key
await sleep(1200);
const route = document.getElementById("route");
console.log("key in use:", key.value);
console.log("route list:", route.children.map((o) => o.value), "selected:", route.value);
console.log("status:", document.getElementById("status").textContent);
if (route.value !== "new-key-route") { console.log("BUG: the list shows the previous key's routes"); process.exit(1); }
