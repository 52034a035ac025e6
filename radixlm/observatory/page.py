"""The /cache page: one HTML file with its own script, drawing the tree from /v1/cache/tree and
the misses from /v1/cache/report, polled every two seconds. Nothing is fetched from elsewhere.

Layout: a node's x is its depth in tokens on a log scale (a 2,000-token system prompt is a long
trunk, a 20-token answer a short twig); leaves take one row each and a parent sits at the middle
of its children. Colors: locked (a running request holds it) orange, next to be evicted red, an
aggregate of small subtrees grey, the rest blue, fading with time since last use.

The page itself is public and holds no data. It draws what the key it is given may see: a
tenant key, that tenant's own namespaces and misses; the admin key, all of them. When the
server has API keys, the data routes answer 401 until the script sends `Authorization: Bearer
KEY`: it takes the key from the URL
fragment (/cache#key=KEY, which never leaves the browser; it is then cleared from the address
bar) or from a field it shows on a 401, and keeps it in sessionStorage (this tab only). Never
from a query string, which would land in access logs.
"""

from __future__ import annotations

CACHE_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>radixlm cache</title>
<style>
body { font: 13px system-ui, sans-serif; margin: 12px; color: #222; }
#stats { margin-bottom: 8px; } svg { border: 1px solid #ddd; }
rect.node { stroke: #333; stroke-width: 0.5; } line { stroke: #999; }
text { font-size: 10px; pointer-events: none; } table { border-collapse: collapse; }
td, th { padding: 2px 8px; border-bottom: 1px solid #eee; text-align: left; }
</style></head><body>
<h1>radixlm cache</h1>
<form id="auth" hidden>This server needs an API key:
<input id="key" type="password" autocomplete="off" size="40"> <button>Use it</button>
(kept in this tab only)</form>
<div id="stats">loading...</div>
<div>orange: locked by a running request &middot; red: next to be evicted &middot;
grey: small subtrees, aggregated &middot; blue: fades with time since last use</div>
<svg id="tree" width="1200" height="200"></svg>
<h2>Misses (requests that asked for a cache report)</h2>
<div id="misses"></div>
<script>
"use strict";
const STORE = "radixlm-api-key";
const NS = "http://www.w3.org/2000/svg";
let updates = 0;

function el(name, attrs, parent) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  parent.appendChild(e);
  return e;
}

function layout(nodes) {
  const kids = new Map(nodes.map(n => [n.id, []]));
  const roots = [];
  for (const n of nodes) (n.parent === null ? roots : kids.get(n.parent)).push(n);
  let row = 0;
  const place = (n, start) => {  // x: depth in tokens (log), y: leaves in order
    const end = start + n.tokens;
    n.x = 20 + 70 * Math.log2(1 + end);
    n.x0 = 20 + 70 * Math.log2(1 + start);
    const cs = kids.get(n.id);
    if (cs.length === 0) { n.y = 20 + 18 * row++; return; }
    for (const c of cs) place(c, end);
    n.y = (cs[0].y + cs[cs.length - 1].y) / 2;
  };
  for (const r of roots) place(r, 0);
  return row;
}

function color(n, clock) {
  if (n.aggregate) return "#bbb";
  if (n.lock_ref > 0) return "#f39c12";
  if (n.next_evicted) return "#e74c3c";
  const age = clock - (n.last_access || 0);
  return `rgba(52, 120, 219, ${Math.max(0.25, 1 - age / 200)})`;
}

function draw(tree) {
  const svg = document.getElementById("tree");
  svg.replaceChildren();
  const rows = layout(tree.nodes);
  svg.setAttribute("height", 40 + 18 * rows);
  const byId = new Map(tree.nodes.map(n => [n.id, n]));
  const clock = Math.max(0, ...tree.nodes.map(n => n.last_access || 0));
  for (const n of tree.nodes) {
    const p = n.parent === null ? null : byId.get(n.parent);
    if (p) el("line", {x1: p.x, y1: p.y, x2: n.x0, y2: n.y}, svg);
    const width = Math.max(3, n.x - n.x0);
    const r = el("rect", {class: "node", x: n.x0, y: n.y - 6, height: 12, width,
      fill: color(n, clock)}, svg);
    el("title", {}, r).textContent = n.aggregate
      ? `${n.count} more branches, ${n.tokens} tokens on their edges`
      : `${n.tokens} tokens, depth ${n.depth}, locks ${n.lock_ref}` +
        (n.hits !== undefined ? `, hits ${n.hits}` : "") + (n.next_evicted ? ", next evicted" : "");
    // a label only where it fits its box (about 6 px a character), aggregates always
    const label = n.aggregate ? `+${n.count}` : (n.text || "").slice(0, Math.floor(width / 6));
    if (label.length > 1) el("text", {x: n.x0 + 2, y: n.y + 3}, svg).textContent = label;
  }
  updates += 1;
  document.getElementById("stats").textContent =
    `${tree.num_nodes} nodes, ${tree.num_tokens} tokens ` +
    `(${tree.protected_tokens} locked), ${tree.nodes.length} shown; update ${updates}`;
  document.body.dataset.updates = updates;
  document.body.dataset.shown = tree.nodes.length;
}

function drawMisses(report) {
  const rows = Object.entries(report.by_reason).map(([r, g]) =>
    `<tr><td>${r}</td><td>${g.count}</td><td>${g.lost_tokens}</td></tr>`).join("");
  document.getElementById("misses").innerHTML =
    `<table><tr><th>reason</th><th>misses</th><th>tokens lost</th></tr>${rows}</table>`;
}

function takeKey() {  // the fragment's key, once, into this tab's storage
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
  if (fromHash) {
    sessionStorage.setItem(STORE, fromHash);
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem(STORE);
}

function askForKey() {
  document.body.dataset.auth = "needed";
  document.getElementById("stats").textContent = "waiting for the API key";
  document.getElementById("auth").hidden = false;
}

document.getElementById("auth").addEventListener("submit", event => {
  event.preventDefault();
  sessionStorage.setItem(STORE, document.getElementById("key").value.trim());
  document.getElementById("auth").hidden = true;
  poll();
});

async function getJson(path) {
  const key = takeKey();
  const r = await fetch(path, {headers: key ? {Authorization: "Bearer " + key} : {}});
  if (r.status === 401) throw "key";
  if (!r.ok) {  // the server's own words (a 403 says which key or option the data needs)
    let message = `${path}: HTTP ${r.status}`;
    try { message = (await r.json()).error.message; } catch (e) {}
    throw message;
  }
  return r.json();
}

async function poll() {
  try {
    const [tree, report] = await Promise.all([
      getJson("/v1/cache/tree"), getJson("/v1/cache/report")]);
    document.body.dataset.auth = "ok";
    draw(tree);
    drawMisses(report);
  } catch (err) {
    if (err === "key") return askForKey();  // polling resumes once a key is given
    document.getElementById("stats").textContent = "error: " + err;
  }
  setTimeout(poll, 2000);
}
poll();
</script></body></html>
"""
