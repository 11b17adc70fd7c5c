// selfattn attention explorer: render(payload) builds the page from captured q, k, v.
//
// For the layer and head on screen it recomputes the guide's steps in float64:
//   scores = q · kᵀ (cosine: q and k normalised first), scaled = scores × scale,
//   weights = softmax(scaled) over each row (rows: queries, columns: keys), output = weights @ v.
// A model that adds a bias to the scaled scores (MPNet's relative position bias: payload.bias) gets
//   weights = softmax(scaled + bias), and its step panel shows the bias. MPNet's comes as its table of
//   one number per head and bucket of key − query distance (relativeBucket), any other bias in full.
// The keys a row may not attend (after the query in a decoder, before its layer's sliding window) get 0.
// Every piece of user text reaches the DOM through textContent, never as HTML.
"use strict";

(() => {
  const BLUES = ["#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b"];
  const LIGHT = { ground: "#ffffff", label: "#5b6b82", axis: "#334155", accent: "#2171b5", pin: "#b45309", masked: "#d4d0cb", ramp: BLUES };
  const TOP_K = 8; // lines drawn per query when there are more than ALL_LINES keys
  const ALL_LINES = 16;
  const OUTPUT_DIMS = 8; // output values listed; the norm covers the rest
  const MAP_BOX_HEIGHT = 760; // .map-scroll's max-height (view.css)

  // ---------- data ----------

  function bytesOf(base64) {
    const binary = atob(base64);
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    return bytes;
  }

  function halfToFloat(bits) {
    const sign = bits & 0x8000 ? -1 : 1;
    const exponent = (bits >> 10) & 0x1f;
    const fraction = bits & 0x3ff;
    if (exponent === 0) return sign * fraction * 2 ** -24;
    if (exponent === 31) return fraction ? NaN : sign * Infinity;
    return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
  }

  /** A {shape, data} tensor from the payload, as a Float32Array (little-endian on the wire). */
  function decodeTensor(tensor, dtype) {
    const bytes = bytesOf(tensor.data);
    const view = new DataView(bytes.buffer);
    const size = tensor.shape.reduce((a, b) => a * b, 1);
    const out = new Float32Array(size);
    if (dtype === "float32") {
      for (let i = 0; i < size; i++) out[i] = view.getFloat32(4 * i, true);
    } else if (dtype === "float16") {
      for (let i = 0; i < size; i++) out[i] = halfToFloat(view.getUint16(2 * i, true));
    } else {
      throw new Error(`unknown dtype ${dtype}`);
    }
    return { shape: tensor.shape, data: out };
  }

  /** Rows of one (layer, head) slice of an (L, H, T, d) tensor, as float64 arrays. */
  function rows(tensor, layer, head, normalise) {
    const [, heads, length, dim] = tensor.shape;
    const start = (layer * heads + head) * length * dim;
    const out = [];
    for (let i = 0; i < length; i++) {
      const row = Float64Array.from(tensor.data.subarray(start + i * dim, start + (i + 1) * dim));
      if (normalise) {
        const norm = Math.max(Math.hypot(...row), 1e-12);
        for (let c = 0; c < dim; c++) row[c] /= norm;
      }
      out.push(row);
    }
    return out;
  }

  /**
   * MPNet's bucket (after T5's) of a key `distance` = key − query positions from its query, in float32
   * steps as Python's selfattn.models.bert.relative_buckets: keys before the query in buckets 0..half − 1,
   * after it in half..buckets − 1; distances below half / 2 exactly, farther ones logarithmically up to
   * maxDistance, beyond it the farthest bucket.
   */
  function relativeBucket(distance, buckets, maxDistance) {
    const half = buckets / 2;
    const exact = half / 2;
    const n = Math.abs(distance);
    const f = Math.fround;
    const far = exact + Math.trunc(f(f(f(Math.log(n / exact)) / f(Math.log(maxDistance / exact))) * (half - exact)));
    return (n < exact ? n : Math.min(far, half - 1)) + (distance > 0 ? half : 0);
  }

  /** The payload's bias: a full tensor, or MPNet's table with the bucket of each distance −(T − 1)..T − 1; null: none. */
  function decodeBias(payload) {
    const bias = payload.bias;
    if (!bias || !bias.table) return bias && decodeTensor(bias, payload.dtype);
    const last = payload.length - 1;
    const bucket = Int32Array.from({ length: 2 * last + 1 }, (_, d) => relativeBucket(d - last, bias.buckets, bias.max_distance));
    return { table: decodeTensor(bias.table, "float32"), bucket };
  }

  /** Row i of the bias that `layer` adds to the scaled scores of `head`, as float64; null: the model adds none. */
  function biasRow(model, layer, head, i) {
    if (!model.bias) return null;
    if (model.bias.table) {
      const { table, bucket } = model.bias; // [H, buckets], every layer's: key j's is the bucket of j − i
      const start = head * table.shape[1];
      return Float64Array.from({ length: model.length }, (_, j) => table.data[start + bucket[j - i + model.length - 1]]);
    }
    const shape = model.bias.shape; // [H, T, S]: every layer's, or [L, H, T, S]: one per layer
    const [heads, length, keys] = shape.slice(-3);
    const start = ((shape.length === 4 ? layer * heads : 0) + head) * length * keys + i * keys;
    return Float64Array.from(model.bias.data.subarray(start, start + keys));
  }

  /** The four steps for one head: scores, scaled, bias (rows of null without one) and weights as T×T row arrays, plus v. */
  function computeHead(model, layer, head) {
    const cosine = model.similarity === "cosine";
    const q = rows(model.query, layer, head, cosine);
    const k = rows(model.key, layer, head, cosine);
    const v = rows(model.value, layer, head, false);
    const t = q.length;
    const s = k.length;
    const scores = [];
    const scaled = [];
    const bias = [];
    const weights = [];
    for (let i = 0; i < t; i++) {
      const score = new Float64Array(s);
      for (let j = 0; j < s; j++) {
        let dot = 0;
        for (let c = 0; c < q[i].length; c++) dot += q[i][c] * k[j][c];
        score[j] = dot;
      }
      const scaledRow = score.map((x) => x * model.scale);
      const added = biasRow(model, layer, head, i);
      scores.push(score);
      scaled.push(scaledRow);
      bias.push(added);
      const position = i + (s - t); // queries aligned bottom-right, as Python aligns them
      const logits = added ? scaledRow.map((x, j) => x + added[j]) : scaledRow;
      weights.push(softmax(logits, firstKey(model, layer, position), model.causal ? position : s - 1));
    }
    return { scores, scaled, bias, weights, value: v };
  }

  /** Softmax over keys first..last (the others masked to weight 0); an empty row stays 0. */
  function softmax(row, first, last) {
    const out = new Float64Array(row.length);
    if (last < first) return out;
    let max = -Infinity;
    for (let j = first; j <= last; j++) max = Math.max(max, row[j]);
    let total = 0;
    for (let j = first; j <= last; j++) total += out[j] = Math.exp(row[j] - max);
    for (let j = first; j <= last; j++) out[j] /= total;
    return out;
  }

  function meanOfHeads(model, layer, headResult) {
    const heads = [];
    for (let h = 0; h < model.heads; h++) heads.push(headResult(layer, h).weights);
    return {
      weights: heads[0].map((_, i) =>
        heads[0][i].map((_, j) => heads.reduce((sum, w) => sum + w[i][j], 0) / heads.length),
      ),
    };
  }

  function outputOf(weightsRow, value) {
    const out = new Float64Array(value[0].length);
    weightsRow.forEach((w, j) => value[j].forEach((x, c) => (out[c] += w * x)));
    return out;
  }

  // ---------- helpers ----------

  /** createElement with attributes; string children become text nodes (never parsed). */
  function h(tag, attrs = {}, ...children) {
    const el = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (name === "class") el.className = value;
      else el.setAttribute(name, value);
    }
    for (const child of children) el.append(child);
    return el;
  }

  const fmt = (x, digits = 4) => (Number.isFinite(x) ? x.toFixed(digits) : String(x));
  // five digits, so that the shown scores times it give the shown scaled ones; 1e-30 is not 0
  const fmtScale = (x) => (x !== 0 && Math.abs(x) < 1e-3 ? x.toExponential(3) : String(Number(x.toPrecision(5))));
  // the letters of a text as a reader counts them: a letter with its marks, an emoji whole
  const letters = (s) =>
    typeof Intl.Segmenter === "function" ? Array.from(new Intl.Segmenter(undefined, { granularity: "grapheme" }).segment(s), (part) => part.segment) : Array.from(s);
  const clip = (s, most) => {
    const parts = letters(s);
    return parts.length > most ? `${parts.slice(0, most - 1).join("")}…` : s;
  };

  /** [r, g, b] of a #rrggbb colour. */
  const channels = (hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));

  /** 256 [r, g, b] steps through the anchors, weight 0 to the largest. */
  function colourRamp(colours) {
    const anchors = colours.map(channels);
    const lut = [];
    for (let n = 0; n < 256; n++) {
      const pos = (n / 255) * (anchors.length - 1);
      const lo = Math.floor(pos);
      const hi = Math.min(lo + 1, anchors.length - 1);
      lut.push(anchors[lo].map((c, i) => Math.round(c + (anchors[hi][i] - c) * (pos - lo))));
    }
    return lut;
  }
  /**
   * The canvases' colours, read from the style sheet (view.css: light, or dark where the reader
   * asks for it, light again in print) so that the cells, the legend and the tokens share one scale.
   * A page without those properties gets the light ones.
   */
  function readPalette() {
    const style = getComputedStyle(document.documentElement);
    const hex = (name, fallback) => {
      const value = style.getPropertyValue(name).trim();
      return /^#[0-9a-f]{6}$/i.test(value) ? value : fallback;
    };
    const ramp = style.getPropertyValue("--ramp").trim().split(/\s+/);
    return {
      ground: hex("--paper", LIGHT.ground),
      label: hex("--muted", LIGHT.label),
      axis: hex("--ink-soft", LIGHT.axis),
      accent: channels(hex("--accent", LIGHT.accent)),
      pin: hex("--pin", LIGHT.pin),
      masked: channels(hex("--masked", LIGHT.masked)), // cells a causal mask hides: grey, not the scale's colour
      ramp: colourRamp(ramp.length >= 2 && ramp.every((c) => /^#[0-9a-f]{6}$/i.test(c)) ? ramp : LIGHT.ramp),
    };
  }
  let palette = null; // readPalette(), again whenever the colour scheme or print changes it
  const shade = (x) => palette.ramp[Math.max(0, Math.min(255, Math.round(x * 255)))];

  /** Relative luminance (WCAG 2) of [r, g, b]. */
  function luminance(colour) {
    const linear = colour.map((c) => ((c /= 255) <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4));
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2];
  }
  /** Black or white, whichever reads better on [r, g, b] (at least 4.5:1 on any colour). */
  const inkOn = (colour) => (luminance(colour) > 0.18 ? "#000" : "#fff");

  /** A token on the ground [r, g, b], in the ink that reads best on it; null: in the page's own colours.
   *  A painted token keeps its colours in forced colours too (view.css): they are its weight. */
  function paintToken(el, colour) {
    el.style.backgroundColor = colour ? `rgb(${colour.join(",")})` : "";
    el.style.color = colour ? inkOn(colour) : "";
    el.classList.toggle("painted", Boolean(colour));
  }

  /** Control characters (an escape sequence) and bidi overrides (they reorder what follows), as terminal.py's CONTROL. */
  const CONTROL = /[\u0000-\u001f\u007f-\u009f\u202a-\u202e\u2066-\u2069]/;
  const CONTROLS = new RegExp(CONTROL.source, "g");
  const hex = (c, digits) => c.charCodeAt(0).toString(16).padStart(digits, "0");
  /** A control character written out: a line break as ↵, a tab as ⇥, the others as \x06 or \u202e (in any font). */
  const escaped = (c) => ({ "\n": "↵", "\t": "⇥" })[c] ?? (c.charCodeAt(0) < 0x100 ? `\\x${hex(c, 2)}` : `\\u${hex(c, 4)}`);
  /** A text as the page shows it, as the command line does: control characters written out, line breaks and tabs kept. */
  const printable = (text) => text.replace(CONTROLS, (c) => (c === "\n" || c === "\t" ? c : escaped(c)));
  /**
   * A token as the page shows it, as the command line does: control characters visible, a token of white
   * space only as ␣ each (a character model's space, a BPE's line break), the rest as written.
   */
  function shown(token) {
    const visible = token.replace(CONTROLS, escaped);
    return (/^\s+$/.test(visible) ? visible.replace(/\s/g, "␣") : visible) || "∅";
  }

  const SPOKEN = { " ": "space", "\n": "line break", "\t": "tab" };
  /**
   * What a screen reader should say for a token that shown() writes with marks (␣, ↵, ⇥, \x06, ∅): its
   * white space and control characters in words ("space", "line break", "tab"); null where it shows as written.
   */
  function spokenToken(token) {
    if (shown(token) === token) return null;
    if (!token) return "empty token";
    const blank = /^\s+$/.test(token);
    const word = (c) => SPOKEN[c] ?? (/\s/.test(c) ? "space" : `control character ${escaped(c)}`);
    const spoken = Array.from(token, (c) => (blank || CONTROL.test(c) ? ` ${word(c)} ` : c));
    return spoken.join("").trim().replace(/ {2,}/g, " ");
  }

  /** A token's element in a strip of tokens, as shown(), named in words where shown() wrote marks. */
  function tokenSpan(token, attrs) {
    const spoken = spokenToken(token);
    return h("span", { ...attrs, dir: "auto", ...(spoken ? { "aria-label": spoken } : {}) }, shown(token));
  }

  /**
   * Token i as prose and the lists of keys name it, after its index: 5 “bank”, 3 “␣” (a space), or 3 '🙂' ([UNK])
   * by the text an unknown token stands for (quoted already), from a payload's tokens and names (as the server
   * sends them; a payload without names: its tokens). Every view names a token so.
   */
  function tokenName(data, i) {
    const name = (data.names ?? data.tokens)[i];
    return `${i} ${name === data.tokens[i] ? `“${shown(name)}”` : shown(name)}`;
  }

  const clamp = (x, n) => Math.max(0, Math.min(n - 1, x | 0));
  const headName = (head) => (head === "mean" ? "mean of heads" : `head ${head}`);

  /** The values of `names` (such as layer, head, query) that the address's hash gives, as strings. */
  function readHash(names) {
    const out = {};
    for (const part of location.hash.replace(/^#/, "").split("&")) {
      const [name, value] = part.split("=");
      if (names.includes(name) && value !== undefined) out[name] = value;
    }
    return out;
  }

  /** Render the payload a page embeds in the script element `id`, where it has one. */
  function renderEmbedded(id, render) {
    const embedded = document.getElementById(id);
    if (embedded && embedded.textContent.trim()) render(JSON.parse(embedded.textContent));
  }

  /**
   * One page kind's render() calls, each owning the window/document listeners it adds (an
   * AbortController's signal): start(root) ends the last render's listeners and gives the new one's
   * signal; clear(root) empties `root`, ending the listeners of the render shown in it (or inside it).
   */
  function renders() {
    let previous = null; // the last render's root and its listeners
    return {
      start(root) {
        previous?.listeners.abort();
        previous = { root, listeners: new AbortController() };
        return previous.listeners.signal;
      },
      clear(root) {
        if (previous && root.contains(previous.root)) previous.listeners.abort();
        root.replaceChildren();
      },
    };
  }

  // ---------- the app ----------

  const explorers = renders();

  /**
   * Build the explorer for one payload inside `root` (replacing what was there).
   * options.hash (default true): read and write the selection in the URL hash;
   * options.onChange(selection): called with {layer, head, query} after every change;
   * options.idPrefix (default ""): put before every id the explorer gives its parts (#layer, #heatmap,
   * ...), so that it can share a page with another view that names its parts alike;
   * options.headingLevel (default 1): the level of its heading (the model's name), its cards' one below.
   */
  function render(payload, root = document.getElementById("app"), options = {}) {
    const { hash = true, onChange = null, idPrefix = "", headingLevel = 1 } = options;
    const signal = explorers.start(root);
    const model = {
      ...payload,
      // every label of a token, as shown: a space or a line break visible, not blank
      tokens: payload.tokens.map(shown),
      names: (payload.names ?? payload.tokens).map(shown),
      spoken: (payload.names ?? payload.tokens).map(spokenToken), // what a screen reader says for a name with marks
      named: payload.tokens.map((_, i) => tokenName(payload, i)), // in prose: 3 '🙂' ([UNK]), as the lists of keys name it
      query: decodeTensor(payload.query, payload.dtype),
      key: decodeTensor(payload.key, payload.dtype),
      value: decodeTensor(payload.value, payload.dtype),
      bias: decodeBias(payload),
    };
    const T = model.length;
    const cache = new Map();
    const headResult = (layer, head) => {
      const name = `${layer}/${head}`;
      if (!cache.has(name)) {
        cache.set(name, head === "mean" ? meanOfHeads(model, layer, headResult) : computeHead(model, layer, head));
      }
      return cache.get(name);
    };
    const state = { layer: 0, head: 0, query: 0, hover: null, shadeBy: "matrix", sortByWeight: false };
    const choose = (changes) => applySelection(state, changes, model, "query", model.length);
    choose(payload.selection || {});
    const asked = hash ? readHash(HASH_NAMES) : {};
    choose(asked);

    const ui = buildLayout(model, (name) => idPrefix + name, headingsFrom(headingLevel));
    noteHash(ui.hashNotice, asked, state, model, ["query", "tokens", model.length]);
    root.replaceChildren(ui.page);
    palette = readPalette();
    const tokenEls = buildTokens(model, payload.tokens, ui.flow);
    const thumbs = buildModelView(model, ui.grid);

    const current = () => headResult(state.layer, state.head);

    function update() {
      const result = current();
      ui.layer.value = String(state.layer);
      ui.head.value = String(state.head);
      const headText = headName(state.head);
      ui.selection.textContent = `layer ${state.layer} · ${headText} · query ${model.named[state.query]}`;
      ui.queryNote.hidden = !model.note || state.query !== model.selection.query;
      ui.choice.hidden = !model.choice || state.layer !== model.selection.layer || state.head !== model.selection.head;
      tokenEls.forEach((el, i) => markChosen(el, i === state.query, "aria-selected"));
      keepTokenInView(ui.flow, tokenEls[state.query]); // a long text's strip scrolls to the query chosen on the map or by the address
      thumbs.forEach((el) => markChosen(el, +el.dataset.layer === state.layer && +el.dataset.head === state.head, "aria-checked"));
      if (state.head === "mean") thumbs[state.layer * model.heads].tabIndex = 0; // Tab still reaches the model view
      draw();
      const { cell, margin } = geometry();
      keepBandInView(ui.map.parentElement, margin + state.query * cell, cell);
      describeSlider(ui.map, state.query, T, describeMap(model, state, result.weights[state.query], headText));
      fillSteps(ui, model, result, state);
      const fragment = `#layer=${state.layer}&head=${state.head}&query=${state.query}`;
      if (hash && location.hash !== fragment) history.replaceState(null, "", fragment);
      onChange?.({ layer: state.layer, head: state.head, query: state.query });
    }

    let mapWidth = 0; // the width of the map's box when the map was drawn
    const geometry = () => mapGeometry(T, mapWidth); // the map's cells and margins, as drawn

    /** The canvases and the token colours for what is chosen, at the window's pixel ratio and colours. */
    function draw() {
      mapWidth = ui.map.parentElement.clientWidth;
      const largest = drawHeatmap(ui.map, current().weights, model, state, geometry());
      drawLegend(ui.legend, palette, state.shadeBy === "row" ? "each row's largest" : fmt(largest, 3));
      showRow(state.hover ?? state.query);
    }

    function showRow(i) {
      const row = current().weights[i];
      const largest = Math.max(...row) || 1;
      tokenEls.forEach((el, j) => {
        const masked = isMasked(model, state.layer, i, j);
        el.classList.toggle("masked", masked);
        const plain = j === i || masked;
        paintToken(el, plain ? null : shade((row[j] / largest) * 0.85));
        el.title = masked ? maskedTitle(model, state.layer, i, j) : `weight ${fmt(row[j])} from query ${i}`;
      });
      const order = [...row.keys()].sort((a, b) => row[b] - row[a]);
      const top = order.slice(0, T <= ALL_LINES ? T : TOP_K).filter((j) => row[j] > 0);
      drawLines(ui.lines, ui.strip, tokenEls, i, top, row);
      fillRowSummary(ui, model, state.layer, row, i, top, state.hover !== null);
    }

    function select(changes) {
      choose(changes);
      ui.hashNotice.hidden = true; // the address now holds what is shown
      update();
    }

    /** Show what an edited hash asks for (the nearest the page has, and a notice, where it has not that). */
    function selectFromHash() {
      const changes = readHash(HASH_NAMES);
      select(changes);
      noteHash(ui.hashNotice, changes, state, model, ["query", "tokens", model.length]);
    }

    ui.layer.addEventListener("change", () => select({ layer: ui.layer.value }));
    ui.head.addEventListener("change", () => select({ head: ui.head.value }));
    ui.shadeBy.addEventListener("change", () => select({ shadeBy: ui.shadeBy.value }));
    ui.sort.addEventListener("change", () => select({ sortByWeight: ui.sort.checked }));
    tokenEls.forEach((el, i) => {
      el.addEventListener("mouseenter", () => ((state.hover = i), showRow(i)));
      el.addEventListener("mouseleave", () => ((state.hover = null), showRow(state.query)));
      el.addEventListener("click", () => select({ query: i }));
    });
    thumbs.forEach((el) =>
      el.addEventListener("click", () => select({ layer: el.dataset.layer, head: el.dataset.head })),
    );
    // Keys on the tokens and the map move the query; on the model view, the layer and head.
    // Focus follows, and only the chosen token and thumbnail are in the Tab order.
    const moveQuery = (event) => {
      const query = steppedQuery(event, state.query, T);
      if (query === null) return;
      event.preventDefault();
      select({ query });
      if (event.currentTarget === ui.flow) tokenEls[state.query].focus();
    };
    ui.flow.addEventListener("keydown", moveQuery);
    mapKeys(ui.map, moveQuery);
    ui.grid.addEventListener("keydown", (event) => {
      const step = steppedThumb(event, state, model);
      if (!step) return;
      event.preventDefault();
      select(step);
      thumbs[state.layer * model.heads + (state.head === "mean" ? 0 : state.head)].focus();
    });
    attachMapEvents(ui, model, state, current, select, geometry);
    if (hash) window.addEventListener("hashchange", selectFromHash, { signal });
    const redrawLines = () => showRow(state.hover ?? state.query);
    // The token strip changes size with the window, and from none to its own when a hidden explorer
    // (drawn while another view of the live page was open) shows again: the query shows, the lines follow its tokens.
    const stripSize = new ResizeObserver(() => {
      keepTokenInView(ui.flow, tokenEls[state.query]);
      redrawLines();
    });
    stripSize.observe(ui.strip);
    // The map fits its box: drawn again when the box's width changes (the window, a hidden view shown), not its height (the map's).
    const mapSize = new ResizeObserver(() => {
      if (ui.map.parentElement.clientWidth !== mapWidth) draw();
    });
    mapSize.observe(ui.map.parentElement);
    signal.addEventListener("abort", () => (stripSize.disconnect(), mapSize.disconnect()));
    // A zoom or a move to another screen changes the pixel ratio: redraw sharp at the new one.
    onPixelRatioChange(draw, signal);
    onColourChange(() => {
      palette = readPalette();
      paintThumbnails(model, thumbs);
      draw();
    }, signal);
    ui.flow.addEventListener("scroll", redrawLines);
    pageKeys(
      root,
      (event) => {
        if (event.key === "ArrowRight") select({ query: Math.min(T - 1, state.query + 1) });
        if (event.key === "ArrowLeft") select({ query: Math.max(0, state.query - 1) });
      },
      signal,
    );
    update();
    document.title = `${model.model}: attention explorer`;
    root.dataset.ready = "true";
  }

  /**
   * Say in `notice` which values of the hash (`asked`) the page has not, such as layer=9 or head=x,
   * and what it shows instead (`state`, where applySelection put them); hidden when it has them all.
   * `position` names the third value and how many the page has: ["query", "tokens", T], ["step", "steps", M].
   */
  function noteHash(notice, asked, state, model, [position, plural, count]) {
    const offered = { layer: ["layers", model.layers], head: ["heads", model.heads], [position]: [plural, count] };
    const onPage = (name, value) => (name === "head" && value === "mean") || (/^\d+$/.test(value) && +value < offered[name][1]);
    const bad = Object.keys(offered).filter((name) => asked[name] !== undefined && !onPage(name, asked[name]));
    notice.hidden = !bad.length;
    const values = bad.map((name) => `${name}=${asked[name]}`).join(" and ");
    const ranges = bad.map((name) => `${offered[name][0]} 0..${offered[name][1] - 1}${name === "head" ? " or mean" : ""}`).join(", ");
    const shown = bad.map((name) => `${name} ${state[name]}`).join(", ");
    notice.textContent = bad.length ? `The address's ${values} ${bad.length > 1 ? "are" : "is"} not on this page (${ranges}): showing ${shown}.` : "";
  }

  const HASH_NAMES = ["layer", "head", "query"]; // the explorer's selection in the address: #layer=l&head=h&query=q

  /**
   * Merge a partial selection (numbers or strings from the hash) into state, in range: its layer, its
   * head, its `position` (the explorer's query, the generation page's step) of `count`, how it shades.
   */
  function applySelection(state, changes, model, position, count) {
    if (changes.layer !== undefined) state.layer = clamp(+changes.layer, model.layers);
    if (changes.head !== undefined) state.head = changes.head === "mean" ? "mean" : clamp(+changes.head, model.heads);
    if (changes[position] !== undefined) state[position] = clamp(+changes[position], count);
    if (changes.shadeBy !== undefined) state.shadeBy = changes.shadeBy;
    if (changes.sortByWeight !== undefined) state.sortByWeight = changes.sortByWeight;
  }

  /**
   * Call `callback` each time window.devicePixelRatio changes (browser zoom, another screen): a
   * media query for the current ratio, made again for the new ratio after each change.
   */
  function onPixelRatioChange(callback, signal) {
    const arm = () => {
      const query = matchMedia(`(resolution: ${window.devicePixelRatio}dppx)`);
      query.addEventListener("change", changed, { once: true, signal });
    };
    const changed = () => {
      if (signal.aborted) return;
      arm();
      callback();
    };
    arm();
  }

  /** On a change of colour scheme, and for print (light, whatever the screen shows): `recolour`. */
  function onColourChange(recolour, signal) {
    const printing = (on) => () => {
      document.documentElement.classList.toggle("printing", on);
      recolour();
    };
    matchMedia("(prefers-color-scheme: dark)").addEventListener("change", recolour, { signal });
    matchMedia("print").addEventListener("change", recolour, { signal });
    window.addEventListener("beforeprint", printing(true), { signal });
    window.addEventListener("afterprint", printing(false), { signal });
  }

  /** Scroll a map's box (not the page) just enough to show the row (query or strip) `height` tall at `top`. */
  function keepBandInView(box, top, height) {
    if (top < box.scrollTop) box.scrollTop = top - height;
    else if (top + height > box.scrollTop + box.clientHeight) box.scrollTop = top + 2 * height - box.clientHeight;
  }

  /** Scroll a token strip's box (not the page) just enough to show the token `el` whole (whole pixels: a scroll rounds). */
  function keepTokenInView(box, el) {
    const area = box.getBoundingClientRect();
    const token = el.getBoundingClientRect();
    if (token.top < area.top) box.scrollTop -= Math.ceil(area.top - token.top);
    else if (token.bottom > area.bottom) box.scrollTop += Math.ceil(token.bottom - area.bottom);
  }

  /** Chosen or not: its class, its ARIA state, and whether Tab reaches it (one per group). */
  function markChosen(el, chosen, ariaState) {
    el.classList.toggle("selected", chosen);
    el.setAttribute(ariaState, String(chosen));
    el.tabIndex = chosen ? 0 : -1;
  }

  /** Whether `el` is on screen: an explorer in a hidden view (another tab of the live page) has no boxes. */
  const onScreen = (el) => el.getClientRects().length > 0;

  /**
   * Keys pressed anywhere on the page while `root` shows, to `handle(event)`: not those a part of the page
   * answered itself (the tokens, the map), nor those in a form's field or on a button, nor with Ctrl, Alt,
   * Meta or Shift (the browser's own: Alt+← is Back). Until `signal` aborts (the next render in `root`).
   */
  function pageKeys(root, handle, signal) {
    document.addEventListener(
      "keydown",
      (event) => {
        if (event.defaultPrevented || event.ctrlKey || event.altKey || event.metaKey || event.shiftKey) return;
        if (event.target.closest?.("select, input, textarea, button") || !onScreen(root)) return;
        handle(event);
      },
      { signal },
    );
  }

  /** The sliding window of `layer` (a query sees itself and the window's previous tokens), or null: none. */
  const windowOf = (model, layer) => model.windows?.[layer] ?? null;

  /** The first key the query at `position` sees in `layer`: the start of its sliding window, or 0. */
  function firstKey(model, layer, position) {
    const width = windowOf(model, layer);
    return width === null ? 0 : Math.max(0, position - width + 1);
  }

  /** Why `layer` hides key j from query i: "later" (a causal mask, bottom-right aligned), "window" (before
   *  the query's sliding window), or null where the query sees the key. */
  function maskOf(model, layer, i, j) {
    if (model.causal && j > i) return "later";
    return j < firstKey(model, layer, i) ? "window" : null;
  }
  const isMasked = (model, layer, i, j) => maskOf(model, layer, i, j) !== null;

  /** What a masked key's title says: why query i may not look at key j. */
  function maskedTitle(model, layer, i, j) {
    return maskOf(model, layer, i, j) === "window" ? outsideWindow(i, j, firstKey(model, layer, i)) : `masked: query ${i} may not look at later tokens`;
  }

  /** What key j says where it lies before the sliding window (keys first..i) of query i. */
  const outsideWindow = (i, j, first) => `masked: key ${j} is outside the sliding window of query ${i} (keys ${first}..${i})`;

  /** The keys `layer` masks, for `who` ("the query", "each query"); "" where it masks none. With a `query`,
   *  only the kinds it has keys of (the last query has no keys after it; an early one none before its window). */
  function maskedKeysText(model, layer, who, query = null) {
    const width = windowOf(model, layer);
    const later = model.causal && (query === null || query < model.length - 1) ? [`keys after ${who}`] : [];
    const before = width !== null && (query === null || firstKey(model, layer, query) > 0) ? [`keys before ${who}'s sliding window of ${width} tokens`] : [];
    return [...later, ...before].join(" and ");
  }

  /** The query a key press on the tokens or the map asks for, or null (not a moving key). */
  function steppedQuery(event, query, T) {
    const target = {
      ArrowRight: query + 1, ArrowDown: query + 1, ArrowLeft: query - 1, ArrowUp: query - 1,
      Home: 0, End: T - 1, Enter: +event.target.dataset.index, " ": +event.target.dataset.index,
    }[event.key];
    return Number.isInteger(target) ? Math.max(0, Math.min(T - 1, target)) : null;
  }

  /** The layer and head an arrow key (or Enter/Space) on a thumbnail asks for, or null. */
  function steppedThumb(event, state, model) {
    const layer = state.layer;
    const head = state.head === "mean" ? 0 : state.head;
    const target = {
      ArrowRight: [layer, head + 1], ArrowLeft: [layer, head - 1], ArrowDown: [layer + 1, head], ArrowUp: [layer - 1, head],
      Enter: [event.target.dataset.layer, event.target.dataset.head], " ": [event.target.dataset.layer, event.target.dataset.head],
    }[event.key];
    return target && event.target.matches(".thumb") ? { layer: target[0], head: target[1] } : null;
  }

  /** The map's text alternative, for describeSlider: what it shows (label) and the chosen row's strongest key (value). */
  function describeMap(model, state, row, headText) {
    const i = state.query;
    const best = row.indexOf(Math.max(...row));
    const hidden = maskedKeysText(model, state.layer, "each query");
    return {
      label:
        `attention map, layer ${state.layer}, ${headText}: ${model.length} queries (rows) × ${model.length} keys (columns)` +
        `${hidden ? `; ${hidden} are masked` : ""}. Arrow keys move the row, Shift+← → scroll a wide map; the step table lists its weights.`,
      value: `Row ${model.named[i]}: most weight, ${fmt(row[best])}, on key ${model.named[best]}.`,
    };
  }

  /**
   * A map canvas as a slider over its rows (the explorer's queries, the generation page's strips), so that a
   * screen reader hands it the arrow keys: `label` says what it shows, `value` what the chosen row `position` of `count` holds.
   */
  function describeSlider(canvas, position, count, { label, value }) {
    canvas.setAttribute("aria-label", label);
    canvas.setAttribute("aria-valuemin", "0");
    canvas.setAttribute("aria-valuemax", String(count - 1));
    canvas.setAttribute("aria-valuenow", String(position));
    canvas.setAttribute("aria-valuetext", value);
  }

  /**
   * Keys on a map canvas: Shift+← and Shift+→ scroll its box sideways (a map wider than the box), the
   * others go to `move(event)`, which moves its row.
   */
  function mapKeys(canvas, move) {
    canvas.addEventListener("keydown", (event) => {
      const sideways = { ArrowLeft: -1, ArrowRight: 1 }[event.key];
      if (!event.shiftKey || !sideways) return move(event);
      event.preventDefault();
      const box = canvas.parentElement;
      box.scrollLeft += sideways * Math.max(box.clientWidth * 0.8, 1);
    });
  }

  /** The header's selects: layer, head (or their mean) and shading, whose `shadings` are [value, text] pairs. */
  function buildControls(model, idOf, shadings) {
    const layer = h("select", { id: idOf("layer"), "aria-label": "layer" });
    for (let l = 0; l < model.layers; l++) layer.append(h("option", { value: String(l) }, `layer ${l}`));
    const head = h("select", { id: idOf("head"), "aria-label": "head" });
    for (let i = 0; i < model.heads; i++) head.append(h("option", { value: String(i) }, `head ${i}`));
    head.append(h("option", { value: "mean" }, "mean of heads"));
    const shadeBy = h("select", { id: idOf("shade-by"), "aria-label": "shade" }, ...shadings.map(([value, text]) => h("option", { value }, `shade: ${text}`)));
    return { layer, head, shadeBy };
  }

  /**
   * The colour scale under a map (the line `lineId`): the same colours as the cells, from weight 0 to what
   * the darkest cell means (drawLegend fills it in), and a grey swatch named `maskedText` where there is one.
   */
  function buildLegend(idOf, lineId, maskedText) {
    const bar = h("canvas", { id: idOf("legend-bar"), class: "legend-bar", width: "256", height: "1", "aria-hidden": "true" });
    const largest = h("span", { id: idOf("legend-largest") });
    const masked = maskedText ? [h("span", { class: "legend-masked" }, h("span", { class: "swatch", "aria-hidden": "true" }), maskedText)] : [];
    const line = h("p", { id: idOf(lineId), class: "legend" }, "weight 0 ", bar, " ", largest, ...masked);
    return { bar, largest, line };
  }

  /**
   * heading(depth, attrs, ...children): a heading `depth` levels below a view's own, which is at `level`
   * (h1 on a page of its own; inside the live explorer, below its page's h1 and its view's h2), styled by
   * its depth (view.css's .depth-0 looks as h1 does) whatever its level.
   */
  const headingsFrom = (level) => (depth, attrs, ...children) =>
    h(`h${Math.min(level + depth, 6)}`, { ...attrs, class: `depth-${depth}` }, ...children);

  /** The page's parts; `idOf(name)` is the id of the part called `name`, `heading` makes its headings (headingsFrom). */
  function buildLayout(model, idOf, heading) {
    const { layer, head, shadeBy } = buildControls(model, idOf, [["matrix", "largest weight"], ["row", "each row's largest"]]);
    const sort = h("input", { type: "checkbox", id: idOf("sort-weight") });
    const similarity = model.similarity === "cosine" ? "cosine similarity" : "dot product";
    const stepText = [
      ["score", model.similarity === "cosine" ? "cos(q, k): how alike query and key are" : "q · k: how alike query and key are"],
      ["scaled", `score × ${fmtScale(model.scale)} so no single score swamps the rest`],
      ...(model.bias ? [["+ bias", "the model's position bias, learned per head and bucket of distances, added to scaled"]] : []),
      ["weight", `softmax${model.bias ? " of scaled + bias" : ""} over the row: between 0 and 1, each row sums to 1`],
      ["output", "Σ weight × v: the weight-averaged values, this head's part of the token in context (the layer projects every head's and adds them to the token's own vector)"],
    ];

    const selection = h("p", { id: idOf("selection"), class: "selection", "aria-live": "polite" });
    // what the first query is of the word asked for (a phrase's first token, a piece): shown while it is the query
    const queryNote = h("p", { id: idOf("query-note"), class: "note", hidden: "" }, model.note || "");
    // why the page opened on its layer and head, where the live explorer chose them (payload.choice): shown while they are on screen
    const choice = h("p", { id: idOf("choice"), class: "note", hidden: "" }, model.choice || "");
    // a value of the address's hash that the page has not (layer=9, head=x), and what it shows instead
    const hashNotice = h("p", { id: idOf("hash-notice"), class: "notice", role: "status", hidden: "" });
    const header = h(
      "header",
      {},
      h("div", { class: "brand" }, "selfattn · attention explorer"),
      heading(0, { id: idOf("model") }, model.model),
      scrollRegion("p", { id: idOf("text"), class: "text", dir: "auto", "aria-label": "text" }, printable(model.text)),
      h(
        "p",
        { class: "meta" },
        `${model.layers} layers × ${model.heads} heads · ${model.length} tokens · ${similarity}` +
          `${model.causal ? " · causal" : ""} · scale ${fmtScale(model.scale)}${model.bias ? " · position bias" : ""}`,
        h("span", { class: "badge" }, "rows: queries, columns: keys"),
      ),
      h("div", { class: "controls" }, layer, head, shadeBy),
      selection,
      choice,
      queryNote,
      hashNotice,
      h(
        "ol",
        { class: model.bias ? "steps biased" : "steps" },
        ...stepText.map(([name, text]) => h("li", {}, h("b", {}, name), " ", text)),
      ),
    );

    const lines = h("canvas", { id: idOf("lines"), class: "lines", "aria-hidden": "true" });
    const flow = h("div", { class: "flow", role: "listbox", "aria-label": "tokens", "aria-orientation": "horizontal" });
    const strip = h("div", { id: idOf("strip"), class: "strip" }, lines, flow);
    const summary = h("div", { id: idOf("row-summary"), class: "row-summary" });
    const map = h("canvas", { id: idOf("heatmap"), class: "heatmap", role: "slider", tabindex: "0" });
    const tip = h("div", { id: idOf("map-tip"), class: "tip", hidden: "" });
    const legend = buildLegend(idOf, "map-legend", model.causal || model.windows ? "masked" : null);
    const stepTitle = heading(2, { id: idOf("step-title") });
    const { table: steps, body: stepsBody, foot: stepsFoot } = buildStepTable(idOf, ["score", "scaled", ...(model.bias ? ["+ bias"] : [])]);
    const stepNote = h("p", { class: "note", id: idOf("step-note") });
    const output = h("div", { id: idOf("output"), class: "output" });
    const grid = h("div", { id: idOf("model-grid"), class: "model-grid", role: "radiogroup", "aria-label": "layer and head" });

    const page = h(
      "div",
      { class: "page" },
      header,
      h(
        "section",
        { class: "card" },
        heading(1, {}, "Tokens"),
        h("p", { class: "hint" }, "Hover a token to see where it looks; click to pin it (← → Home End move)."),
        strip,
        summary,
      ),
      h(
        "div",
        { class: "columns" },
        h(
          "section",
          { class: "card" },
          heading(1, {}, "Attention map"),
          h("p", { class: "hint" }, "rows: queries, columns: keys · click a row to select its query (↑ ↓ move; Shift+← → scroll a wide map)"),
          h("div", { class: "map-scroll" }, map, tip),
          legend.line,
        ),
        h(
          "section",
          { class: "card" },
          heading(1, { id: idOf("steps-heading") }, "Step by step"),
          stepTitle,
          h("label", { class: "sort" }, sort, " sort keys by weight"),
          scrollRegion("div", { class: "steps-scroll", "aria-labelledby": idOf("steps-heading") }, steps),
          stepNote,
          output,
        ),
      ),
      h(
        "section",
        { class: "card" },
        heading(1, {}, "Model view"),
        h("p", { class: "hint" }, "Every layer × head (rows: queries, columns: keys), each scaled to its own largest weight; click one to select it."),
        grid,
      ),
    );
    return { page, idOf, heading, layer, head, shadeBy, sort, selection, choice, queryNote, hashNotice, lines, flow, strip, summary, map, tip, legend, stepsBody, stepsFoot, stepTitle, stepNote, output, grid };
  }

  /** The tokens (as the payload has them) in the strip `flow`, an option each. */
  function buildTokens(model, tokens, flow) {
    return tokens.map((token, i) => {
      const words = model.words;
      const joined = words && i > 0 && words[i] !== null && words[i] === words[i - 1];
      const el = tokenSpan(token, { class: joined ? "token joined" : "token", "data-index": String(i), role: "option" });
      flow.append(el);
      return el;
    });
  }

  function buildModelView(model, grid) {
    const n = model.thumbnails.size;
    grid.style.gridTemplateColumns = `max-content repeat(${model.heads}, 64px)`;
    grid.append(h("span"));
    for (let hd = 0; hd < model.heads; hd++) grid.append(h("span", { class: "axis" }, `h${hd}`));
    const thumbs = [];
    for (let l = 0; l < model.layers; l++) {
      grid.append(h("span", { class: "axis" }, `L${l}`));
      for (let hd = 0; hd < model.heads; hd++) {
        const name = `layer ${l}, head ${hd}`;
        const canvas = h("canvas", { class: "thumb", width: String(n), height: String(n), "data-layer": String(l), "data-head": String(hd), title: name, role: "radio", "aria-label": name });
        grid.append(canvas);
        thumbs.push(canvas);
      }
    }
    paintThumbnails(model, thumbs);
    return thumbs;
  }

  /** Each thumbnail's pooled weights in the palette's colours. */
  function paintThumbnails(model, thumbs) {
    const n = model.thumbnails.size;
    const bytes = bytesOf(model.thumbnails.data);
    thumbs.forEach((canvas, t) => {
      const image = new ImageData(n, n);
      const offset = t * n * n; // thumbs are in layer-major, head-minor order, as the payload
      const layer = Math.floor(t / model.heads);
      for (let p = 0; p < n * n; p++) {
        const colour = maskedPool(model, layer, n, Math.floor(p / n), p % n) ? palette.masked : shade(bytes[offset + p] / 255);
        image.data.set([...colour, 255], 4 * p);
      }
      canvas.getContext("2d").putImageData(image, 0, 0);
    });
  }

  /**
   * A max-pooled thumbnail cell is masked when every cell it pools is (adaptive pooling's bins): when the
   * bin's corner nearest the keys its queries see is, its last row's first key for keys after the queries,
   * its first row's last key for keys before their sliding window.
   */
  function maskedPool(model, layer, n, r, c) {
    const T = model.length;
    const [firstRow, lastRow] = [Math.floor((r * T) / n), Math.ceil(((r + 1) * T) / n) - 1];
    const [firstCol, lastCol] = [Math.floor((c * T) / n), Math.ceil(((c + 1) * T) / n) - 1];
    return maskOf(model, layer, lastRow, firstCol) === "later" || maskOf(model, layer, firstRow, lastCol) === "window";
  }

  // ---------- drawing ----------

  /**
   * Cells and margins of the heatmap for T tokens in a box `width` px wide: the whole map fits the box (and
   * its height, so that no scroll bar takes width from it), token labels while cells are 9 px or more, else
   * indices; cells 44 px at most and 3 px at the least, where the box scrolls.
   */
  function mapGeometry(T, width) {
    const room = Math.min(width, MAP_BOX_HEIGHT);
    const fit = (margin, right) => Math.max(3, Math.min(44, Math.floor((room - margin - right) / T)));
    const cell = fit(84, 84); // right: room for the last rotated key label
    if (cell >= 9) return { cell, labels: true, margin: 84, right: 84 };
    return { cell: fit(36, 14), labels: false, margin: 36, right: 14 }; // right: the last index label and the pin
  }

  /** The colour scale: the palette's 256 steps, weight 0 at the left; `largest` says what the right end means. */
  function drawLegend(legend, palette, largest) {
    const image = new ImageData(256, 1);
    for (let n = 0; n < 256; n++) image.data.set([...palette.ramp[n], 255], 4 * n);
    legend.bar.getContext("2d").putImageData(image, 0, 0);
    legend.largest.textContent = largest;
  }

  /** Size `canvas` to width × height CSS pixels at the window's pixel ratio; its 2D context, drawing in CSS pixels. */
  function sizedContext(canvas, width, height) {
    const dpr = window.devicePixelRatio || 1;
    canvas.width = width * dpr;
    canvas.height = height * dpr;
    canvas.style.width = `${width}px`;
    canvas.style.height = `${height}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return ctx;
  }

  /** `image` (one pixel per cell) scaled up, unsmoothed, into the box at (left, top), width × height. */
  function drawCells(ctx, image, left, top, width, height) {
    const cells = new OffscreenCanvas(image.width, image.height);
    cells.getContext("2d").putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(cells, left, top, width, height);
  }

  /** What a map's rows and columns are, in its top left corner. */
  function drawAxisNames(ctx, palette) {
    ctx.fillStyle = palette.label;
    ctx.font = "italic 11px system-ui, sans-serif";
    ctx.fillText("rows: queries", 2, 12);
    ctx.fillText("columns: keys", 2, 26);
  }

  /** A key's label over its column, rising to the right from (x, y). */
  function drawKeyLabel(ctx, text, x, y) {
    ctx.save();
    ctx.translate(x, y);
    ctx.rotate(-Math.PI / 4);
    ctx.textAlign = "left";
    ctx.fillText(text, 0, 0);
    ctx.restore();
  }

  /** The chosen row's outline around the box at (left, top), width × height: the pin's colour between two lines
   *  of the ground's, so that it stands out at 3:1 on cells of any colour. */
  function drawPin(ctx, palette, left, top, width, height) {
    ctx.strokeStyle = palette.ground;
    ctx.lineWidth = 4;
    ctx.strokeRect(left - 2, top - 2, width + 4, height + 4);
    ctx.strokeStyle = palette.pin;
    ctx.lineWidth = 2;
    ctx.strokeRect(left - 2, top - 2, width + 4, height + 4);
  }

  /** The T×S map on one canvas (one pixel per cell, scaled up) in the cells and margins mapGeometry gives;
   *  masked cells in grey. Returns the largest weight, the colour scale's end. */
  function drawHeatmap(canvas, weights, model, state, { cell, labels, margin, right }) {
    const T = weights.length;
    const tokens = model.tokens;
    const side = margin + T * cell;
    const width = side + right;
    const ctx = sizedContext(canvas, width, side);
    ctx.fillStyle = palette.ground;
    ctx.fillRect(0, 0, width, side);

    const S = weights[0].length;
    const image = new ImageData(S, T);
    const matrixMax = Math.max(...weights.map((row) => Math.max(...row))) || 1;
    weights.forEach((row, i) => {
      const top = state.shadeBy === "row" ? Math.max(...row) || 1 : matrixMax;
      row.forEach((w, j) => {
        const masked = isMasked(model, state.layer, i, j);
        image.data.set([...(masked ? palette.masked : shade(w / top)), 255], 4 * (i * S + j));
      });
    });
    drawCells(ctx, image, margin, margin, T * cell, T * cell);

    if (labels) drawAxisNames(ctx, palette);
    ctx.fillStyle = palette.axis;
    ctx.font = `${Math.min(12, cell)}px system-ui, sans-serif`;
    if (labels) {
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      tokens.forEach((tok, i) => ctx.fillText(clip(tok, 10), margin - 6, margin + (i + 0.5) * cell));
      tokens.forEach((tok, j) => drawKeyLabel(ctx, clip(tok, 10), margin + (j + 0.5) * cell, margin - 6));
    } else {
      ctx.font = "10px system-ui, sans-serif";
      const step = [5, 10, 20, 50, 100, 200].find((s) => s * cell >= 28) || 500;
      ctx.textBaseline = "middle";
      for (let i = 0; i < T; i += step) {
        ctx.textAlign = "right";
        ctx.fillText(String(i), margin - 4, margin + (i + 0.5) * cell);
        ctx.textAlign = "center";
        ctx.fillText(String(i), margin + (i + 0.5) * cell, margin - 10);
      }
    }
    drawPin(ctx, palette, margin, margin + state.query * cell, T * cell, cell);
    return matrixMax;
  }

  /**
   * Over the token strip, the query's top keys; width ∝ weight. A key on the query's line: a curve from the
   * query, in the space above the line; a key on another line: a mark over it (a curve would cross the lines
   * between); the query itself: a loop.
   */
  function drawLines(canvas, strip, tokenEls, i, top, row) {
    const box = strip.getBoundingClientRect();
    const ctx = sizedContext(canvas, box.width, box.height);
    const place = (el) => {
      const r = el.getBoundingClientRect();
      return { left: r.left - box.left, right: r.right - box.left, x: r.left + r.width / 2 - box.left, y: r.top - box.top + 2, height: r.height };
    };
    const query = place(tokenEls[i]);
    const gap = parseFloat(getComputedStyle(tokenEls[i].parentElement).lineHeight) - query.height; // between two lines' tokens
    const largest = row[top[0]] || 1;
    for (const j of top) {
      const key = place(tokenEls[j]);
      const strength = row[j] / largest;
      ctx.strokeStyle = `rgba(${palette.accent.join(", ")}, ${0.25 + 0.7 * strength})`;
      ctx.lineWidth = 1 + 4 * strength;
      ctx.beginPath();
      if (j === i) {
        ctx.moveTo(query.x, query.y);
        ctx.arc(query.x, query.y - 7, 7, Math.PI / 2, Math.PI * 2.5);
      } else if (Math.abs(key.y - query.y) < query.height / 2) {
        const lift = Math.min(gap - 3, 10 + Math.abs(key.x - query.x) / 6); // the curve rises ¾ of it
        ctx.moveTo(query.x, query.y);
        ctx.bezierCurveTo(query.x, query.y - lift, key.x, key.y - lift, key.x, key.y);
      } else {
        ctx.moveTo(key.left + 2, key.y - 6);
        ctx.lineTo(key.right - 2, key.y - 6);
      }
      ctx.stroke();
    }
  }

  function fillRowSummary(ui, model, layer, row, i, top, preview) {
    const head = h("p", { class: "summary-head" }, preview ? "preview: " : "", "query ", h("b", {}, model.named[i]), " looks at");
    const names = model.names; // as Python's lists name them: '🙂' ([UNK]) by the text it stands for
    const repeated = (name) => names.indexOf(name) !== names.lastIndexOf(name);
    const name = (j) => (repeated(names[j]) ? `${j}:${names[j]}` : names[j]); // "9:river" where the text has it twice
    const rest = row.filter((w, j) => w > 0 && !top.includes(j)).length;
    const masked = row.filter((w, j) => isMasked(model, layer, i, j)).length;
    const zero = row.length - top.length - rest - masked; // not masked: exp(scaled) underflowed to 0
    const keys = (n) => `${n} key${n > 1 ? "s" : ""}`;
    const also = (masked > 0 ? ` · ${keys(masked)} masked` : "") + (zero > 0 ? ` · ${keys(zero)} at weight 0 (too far below the largest score)` : "");
    ui.summary.replaceChildren(head, ...topKeys(ui.idOf, row, top, (j) => j, name, { rest, allShown: "every attended key shown", also }));
  }

  /**
   * A list of the keys `top` (indices into `row`, largest weight first) with their weights and bars, and a
   * line for the weight left on the `rest` other keys (`allShown` where there are none) and `also` after it.
   * `key(j)` is the token index of row[j]; `name(j)` how the list names it.
   */
  function topKeys(idOf, row, top, key, name, { rest, allShown, also }) {
    const largest = row[top[0]] || 1;
    const list = h("ol", { class: "top-keys", id: idOf("top-keys") });
    for (const j of top) {
      const bar = h("span", { class: "bar" });
      bar.style.width = `${(row[j] / largest) * 100}%`;
      list.append(
        h("li", { "data-key": String(key(j)), "data-weight": String(row[j]) }, h("span", { class: "tok" }, name(j)), h("span", { class: "bar-track" }, bar), h("span", { class: "num" }, fmt(row[j], 3))),
      );
    }
    const restMass = Math.max(0, 1 - top.reduce((sum, j) => sum + row[j], 0));
    const leftover = h("p", { class: "leftover", id: idOf("leftover"), "data-mass": String(restMass) });
    leftover.textContent = (rest > 0 ? `+ ${fmt(restMass, 3)} on ${rest} other key${rest > 1 ? "s" : ""}` : allShown) + also;
    return [list, leftover];
  }

  /**
   * A step table (the explorer's step panel, the generation page's chosen step): per key its index and
   * name, the `columns` (the explorer's score, scaled, + bias), its weight and a bar; named by the card's
   * heading and its title (ids steps-heading and step-title).
   */
  function buildStepTable(idOf, columns) {
    const body = h("tbody");
    const foot = h("tfoot");
    const headers = ["key", ...columns, "weight"].map((name) => h("th", { scope: "col" }, name));
    const table = h(
      "table",
      { id: idOf("steps"), class: "step-table", "aria-labelledby": `${idOf("steps-heading")} ${idOf("step-title")}` },
      h("thead", {}, h("tr", {}, ...headers, h("td", { class: "bar-cell", "aria-hidden": "true" }))), // over the bars: nothing to read
      body,
      foot,
    );
    return { table, body, foot };
  }

  /**
   * Key j's row of a step table: its index and `name`, `cells`, its `weight` and a bar as long as weight /
   * `largest`; `self`: the query's own key; `masked`: why the query may not look at it (a tag in the bar's place), or false;
   * `spoken`: the name in words for a screen reader (spokenToken), where the shown name has marks (␣, ↵).
   */
  function weightRow(j, name, cells, weight, largest, { self = false, masked = false, spoken = null }) {
    const said = spoken ? [h("span", { "aria-hidden": "true" }, name), h("span", { class: "visually-hidden" }, spoken)] : [name];
    const bar = h("span", { class: "bar" });
    bar.style.width = `${(weight / largest) * 100}%`;
    return h(
      "tr",
      { "data-key": String(j), class: [self ? "self" : "", masked ? "masked" : ""].join(" ").trim() },
      h("td", { class: "key" }, h("span", { class: "idx" }, String(j)), " ", h("bdi", {}, ...said)),
      ...cells,
      h("td", { class: "num strong", "data-weight": String(weight) }, fmt(weight)),
      h("td", { class: "bar-cell" }, masked ? h("span", { class: "tag", title: masked }, "masked") : h("span", { class: "bar-track" }, bar)),
    );
  }

  /** A step table's foot: the weights' total, under `blanks` empty cells. */
  function totalRow(weights, blanks) {
    const total = weights.reduce((a, b) => a + b, 0);
    const empty = Array.from({ length: blanks }, () => h("td"));
    return h("tr", {}, h("td", {}, "total"), ...empty, h("td", { class: "num strong" }, fmt(total)), h("td", { class: "bar-cell" }));
  }

  /** A box that scrolls (a long text, a table): a named region the keyboard can reach and scroll. */
  function scrollRegion(tag, attrs, ...children) {
    return h(tag, { ...attrs, role: "region", tabindex: "0" }, ...children);
  }

  function fillSteps(ui, model, result, state) {
    const i = state.query;
    const mean = state.head === "mean";
    const weights = result.weights[i];
    const largest = Math.max(...weights) || 1;
    ui.stepTitle.textContent = `query ${model.named[i]}`;
    const hidden = maskedKeysText(model, state.layer, "the query", i);
    const order = [...weights.keys()];
    if (state.sortByWeight) order.sort((a, b) => weights[b] - weights[a]);
    const masked = (j) => isMasked(model, state.layer, i, j);
    const perHead = model.bias ? 3 : 2; // the columns of single heads: score, scaled and, with a bias, + bias
    ui.stepsBody.replaceChildren(
      ...order.map((j) => {
        const cells = mean
          ? Array.from({ length: perHead }, () => h("td", { class: "num na" }, "—"))
          : [
              h("td", { class: "num", "data-score": String(result.scores[i][j]) }, fmt(result.scores[i][j])),
              h("td", { class: "num", "data-scaled": String(result.scaled[i][j]) }, fmt(result.scaled[i][j])),
              ...(model.bias ? [h("td", { class: "num", "data-bias": String(result.bias[i][j]) }, fmt(result.bias[i][j]))] : []),
            ];
        const why = masked(j) && maskedTitle(model, state.layer, i, j);
        return weightRow(j, model.names[j], cells, weights[j], largest, { self: j === i, masked: why, spoken: model.spoken[j] });
      }),
    );
    ui.stepsFoot.replaceChildren(totalRow(weights, perHead));
    const tensors = model.bias && !model.bias.table ? "q, k, v and the bias" : "q, k and v"; // a table is float32
    const rounded = model.dtype === "float16" ? ` ${tensors} came as float16 to keep this long text's page small: the numbers agree with Python's to 2 or 3 significant digits (a score near 0, to about 3 digits of the row's largest).` : "";
    const biased = model.bias ? " + bias" : "";
    const bias = model.bias ? "; bias: the model's position bias for this query and key (it depends on their distance)" : "";
    ui.stepNote.textContent =
      (mean
        ? `mean of ${model.heads} heads: the weights are averaged; scores${model.bias ? ", biases" : ""} and outputs belong to single heads.`
        : `scaled = score × ${fmtScale(model.scale)}; weight = softmax(scaled${biased}) over the row${bias}${hidden ? `; ${hidden} are masked (as if scaled were −∞): weight 0` : ""}; the total adds the weights before rounding.`) + rounded;

    if (mean) {
      ui.output.replaceChildren();
      return;
    }
    const output = outputOf(weights, result.value);
    const norm = Math.hypot(...output);
    const dims = [...output.slice(0, OUTPUT_DIMS)].map((x, c) => h("span", { class: "output-dim", "data-dim": String(c), "data-value": String(x) }, fmt(x, 3)));
    ui.output.replaceChildren(
      ui.heading(2, {}, "output = Σ weight × v"),
      h("div", { class: "vector" }, "[", ...dims, output.length > OUTPUT_DIMS ? `… ${output.length - OUTPUT_DIMS} more]` : "]"),
      h(
        "p",
        {},
        "norm ",
        h("b", { id: ui.idOf("output-norm"), "data-value": String(norm) }, fmt(norm, 3)),
        ` · ${output.length} dims · keeps `,
        h("b", { id: ui.idOf("self-weight"), "data-value": String(weights[i]) }, `${fmt(100 * weights[i], 1)}%`),
        " of its attention on itself",
      ),
    );
    ui.output.dataset.values = JSON.stringify([...output]);
  }

  function attachMapEvents(ui, model, state, current, select, geometry) {
    const cellAt = (event) => {
      const { cell, margin } = geometry();
      const r = ui.map.getBoundingClientRect();
      const i = Math.floor((event.clientY - r.top - margin) / cell);
      const j = Math.floor((event.clientX - r.left - margin) / cell);
      return i >= 0 && j >= 0 && i < model.length && j < model.length ? [i, j] : null;
    };
    attachCellEvents(ui.map, ui.tip, {
      cellAt,
      hover: ([i, j]) => `query ${model.named[i]} → key ${model.named[j]}: ${fmt(current().weights[i][j])}`,
      pick: ([i]) => select({ query: i }),
    });
  }

  /**
   * A map canvas's tip and clicks. `cellAt(event)`: the [row, column] under the pointer, or null off
   * the cells; over one, `hover(cell)` gives the tip's text; a click on one calls `pick(cell)`, and
   * `leave()` (if given) follows the tip away when the pointer leaves the canvas.
   */
  function attachCellEvents(canvas, tip, { cellAt, hover, pick, leave }) {
    canvas.addEventListener("mousemove", (event) => {
      const at = cellAt(event);
      tip.hidden = !at;
      if (!at) return;
      tip.textContent = hover(at);
      placeTip(tip, event);
    });
    canvas.addEventListener("mouseleave", () => {
      tip.hidden = true;
      leave?.();
    });
    canvas.addEventListener("click", (event) => {
      const at = cellAt(event);
      if (at) pick(at);
    });
  }

  /** The tip next to the pointer, on whichever side keeps it inside the window (it is fixed: the map's
   *  scroll box does not clip it). */
  function placeTip(tip, event) {
    const gap = 14;
    const { clientWidth, clientHeight } = document.documentElement;
    const side = (at, size, room) => Math.max(0, at + gap + size <= room ? at + gap : at - gap - size);
    tip.style.left = `${side(event.clientX, tip.offsetWidth, clientWidth)}px`;
    tip.style.top = `${side(event.clientY, tip.offsetHeight, clientHeight)}px`;
  }

  // render, clear, h and fmt are shared with the live explorer (serve.js), which loads after this file;
  // h, fmt and the rest with the page of attention during generation (generation.js).
  window.selfattn = {
    render, clear: explorers.clear, h, headingsFrom, fmt, fmtScale, printable, shown, spokenToken, tokenSpan, tokenName, describeSlider, mapKeys, buildStepTable, weightRow, totalRow, scrollRegion, decodeTensor, readPalette, channels, clip, paintToken, headName,
    readHash, noteHash, renderEmbedded, renders, applySelection, markChosen, onPixelRatioChange, onColourChange, keepBandInView, keepTokenInView,
    buildControls, buildLegend, topKeys, drawLegend, sizedContext, drawCells, drawAxisNames, drawKeyLabel, drawPin, attachCellEvents,
    windowOf, outsideWindow, pageKeys,
  };
  renderEmbedded("selfattn-payload", render);
})();
