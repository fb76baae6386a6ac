// Building the page from elements, never from markup strings: every string from the
// server lands in a text node or an attribute set through the DOM, never parsed as markup.

const SVG_NS = "http://www.w3.org/2000/svg";

function append(el, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function setAttrs(el, attrs) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else if (key === "dataset") {
      Object.assign(el.dataset, value);
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
  return el;
}

/** An HTML element: h("a", {href: "#/jobs"}, "Jobs"). */
export function h(tag, attrs, ...children) {
  return append(setAttrs(document.createElement(tag), attrs), children);
}

/** An SVG element (same arguments as h). */
export function s(tag, attrs, ...children) {
  return append(setAttrs(document.createElementNS(SVG_NS, tag), attrs), children);
}

/** Replace an element's children. */
export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

function finite(v) {
  return typeof v === "number" && Number.isFinite(v);
}

/** A number for people: 3 significant decimals for small values, grouped for large. */
export function num(v, digits = 3) {
  if (!finite(v)) return "–";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en");
  if (Number.isInteger(v)) return String(v);
  return v.toFixed(digits);
}

/** Three significant digits, no trailing zeros: axis labels and metric values. */
export function short(v) {
  if (!finite(v)) return "–";
  if (Math.abs(v) >= 1000 || Number.isInteger(v)) return num(v);
  return String(Number(v.toPrecision(3)));
}

export function bytes(v) {
  if (!finite(v)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) {
    v /= 1000;
    i += 1;
  }
  return `${i === 0 ? v : v.toFixed(v < 10 ? 2 : 1)} ${units[i]}`;
}

/** A span of seconds: 42.0s, 12.5min, 3.20h, 2.1d (as `flotilla simulate` prints it). */
export function duration(seconds) {
  if (!finite(seconds)) return "–";
  const a = Math.abs(seconds);
  if (a < 120) return `${seconds.toFixed(1)}s`;
  if (a < 7200) return `${(seconds / 60).toFixed(1)}min`;
  if (a < 172800) return `${(seconds / 3600).toFixed(2)}h`;
  return `${(seconds / 86400).toFixed(1)}d`;
}

/** Unix seconds as this browser's local time of day. */
export function clock(t) {
  if (!finite(t) || t <= 0) return "–";
  return new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false });
}

/** A moment for people: a server's unix time as "12s ago"; a simulation's clock as t=. */
export function when(t, source) {
  if (!finite(t) || t <= 0) return "never";
  if (source === "simulation") return `t=${duration(t)}`;
  const ago = Date.now() / 1000 - t;
  if (ago < 0) return clock(t);
  return ago < 2 ? "just now" : `${duration(ago)} ago`;
}

/** A job or device state as a coloured badge (text, never colour alone). */
export function badge(state) {
  return h("span", { class: `badge state-${String(state).replace(/[^a-z_-]/g, "")}` }, state);
}

/** A labelled progress bar: rounds committed of rounds total. */
export function progress(done, total, label) {
  const pct = total > 0 ? Math.min(100, (100 * done) / total) : 0;
  return h(
    "div",
    { class: "progress-wrap" },
    h(
      "div",
      {
        class: "progress",
        role: "progressbar",
        "aria-label": label,
        "aria-valuemin": 0,
        "aria-valuemax": total || 0,
        "aria-valuenow": done,
      },
      h("div", { class: "progress-fill", style: `width:${pct.toFixed(1)}%` }),
    ),
    h("span", { class: "progress-text" }, total > 0 ? `${done} / ${total}` : `${done}`),
  );
}

/** A table that scrolls sideways on a narrow screen. */
export function table(caption, headers, rows) {
  return h(
    "div",
    { class: "scroll", tabindex: 0, role: "region", "aria-label": caption },
    h(
      "table",
      {},
      h("caption", { class: "visually-hidden" }, caption),
      h("thead", {}, h("tr", {}, headers.map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, rows),
    ),
  );
}

/**
 * Make `from` look like `to`, touching only what differs: a live update keeps the
 * element under the pointer, focus, an open list and scroll positions. Behaviour hangs
 * on data-action attributes (one listener on the page), so reused elements stay right.
 */
export function morph(from, to) {
  if (from.nodeType !== to.nodeType || from.nodeName !== to.nodeName) {
    from.replaceWith(to);
    return;
  }
  if (from.nodeType !== Node.ELEMENT_NODE) {
    if (from.nodeValue !== to.nodeValue) from.nodeValue = to.nodeValue;
    return;
  }
  for (const attr of [...from.attributes]) {
    if (!to.hasAttribute(attr.name)) from.removeAttribute(attr.name);
  }
  for (const attr of to.attributes) {
    if (from.getAttribute(attr.name) !== attr.value) from.setAttribute(attr.name, attr.value);
  }
  const old = [...from.childNodes];
  const fresh = [...to.childNodes];
  fresh.forEach((child, i) => {
    if (i < old.length) morph(old[i], child);
    else from.append(child);
  });
  for (let i = fresh.length; i < old.length; i += 1) old[i].remove();
}
