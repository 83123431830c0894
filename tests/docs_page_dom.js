// A DOM just large enough to run the /docs page's script under node (tests/test_docs_page.py).
// Reads {"script", "body": {dataset}, "document"} as JSON on stdin, runs the script with a
// fetch that answers the document, and prints what the page shows: every operation
// rendered (its summary line and the text of its details) and the error line.
"use strict";

class Node {
  constructor(tag) {
    this.tag = tag;
    this.attrs = {};
    this.dataset = {};
    this.childNodes = [];
    this.listeners = {};
    this.hidden = false;
    this.value = "";
    this._text = "";
  }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  appendChild(c) { this.childNodes.push(c); return c; }
  addEventListener(type, fn) { this.listeners[type] = fn; }
  get textContent() {
    return this._text + this.childNodes.map((c) => c.textContent).join("");
  }
  set textContent(v) { this._text = String(v); this.childNodes = []; }
  walk(out) {
    out.push(this);
    this.childNodes.forEach((c) => c instanceof Node && c.walk(out));
    return out;
  }
}

class Text {
  constructor(t) { this.text = String(t); }
  get textContent() { return this.text; }
}

const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const ids = {};
for (const id of ["title", "info", "filter", "key", "raw", "error", "operations"]) {
  ids[id] = new Node("div");
}
const document = {
  body: Object.assign(new Node("body"), {dataset: input.body}),
  title: "",
  createElement: (tag) => new Node(tag),
  createTextNode: (t) => new Text(t),
  getElementById: (id) => ids[id],
  querySelectorAll: (sel) => ids.operations.walk([]).filter((n) => n.tag === "details"),
};
const fetched = [];
function fetch(url, init) {
  fetched.push(url);
  const ok = url === input.body.openapi;
  return Promise.resolve({
    ok: ok,
    status: ok ? 200 : 404,
    json: () => Promise.resolve(input.document),
    text: () => Promise.resolve(JSON.stringify(input.document)),
  });
}

new Function("document", "fetch", input.script)(document, fetch);

setTimeout(() => {
  const details = ids.operations.walk([]).filter((n) => n.tag === "details");
  const operations = details.map((d) => {
    const [method, path, summary] = d.childNodes[0].childNodes.map((c) => c.textContent);
    return {method, path, summary, text: d.textContent, search: d.dataset.search};
  });
  // the filter hides what does not match every word typed
  ids.filter.listeners.input({target: {value: input.filter || ""}});
  const shown = details.filter((d) => !d.hidden).map((d) => d.childNodes[0].childNodes[1].textContent);
  process.stdout.write(JSON.stringify({
    fetched: fetched,
    title: ids.title.textContent,
    error: ids.error.textContent,
    operations: operations,
    shown: shown,
  }));
}, 50);
