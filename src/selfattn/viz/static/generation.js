// selfattn: attention during generation. One strip (row) per generated token: the query row of
// the step that chose it (its query is the token before it) over its keys, the prompt and the
// tokens generated so far. Rows are queries, columns are keys; the keys before a layer's sliding window
// (Mistral's, Qwen's: payload.windows) are masked, grey. Loads after view.js and uses its
// helpers; every piece of user text reaches the DOM through textContent, never as HTML. The
// offline page renders its embedded payload; the live explorer's Generate view calls
// window.selfattn.generation.render(payload, element, options) with the API's.
"use strict";

(() => {
  const {
    h, headingsFrom, fmt, decodeTensor, readPalette, channels, clip, paintToken, headName, readHash, noteHash, renderEmbedded, renders, applySelection,
    markChosen, onPixelRatioChange, onColourChange, keepBandInView, keepTokenInView, buildControls, buildLegend, topKeys, drawLegend, sizedContext,
    drawCells, drawAxisNames, drawKeyLabel, drawPin, attachCellEvents, windowOf, outsideWindow, printable, shown, spokenToken, tokenSpan, tokenName, pageKeys,
    describeSlider, mapKeys, buildStepTable, weightRow, totalRow, scrollRegion,
  } = window.selfattn;
  const TOP_KEYS = 6; // keys listed for the chosen strip; the rest is one line of left-over weight

  // ---------- data ----------

  /** Where each step's weights start along the payload's last axis (steps one after the other). */
  function stepOffsets(model) {
    let at = 0;
    return model.queries.map((query, s) => {
      const offset = at;
      at += query - model.starts[s] + 1;
      return offset;
    });
  }

  /** One step's weights over its keys starts[s]..queries[s]: one head, or the mean of the heads. */
  function stepWeights(model, layer, head, s) {
    const count = model.queries[s] - model.starts[s] + 1;
    const total = model.weights.shape[2];
    const heads = head === "mean" ? [...Array(model.heads).keys()] : [head];
    const out = new Float64Array(count);
    for (const hd of heads) {
      const base = (layer * model.heads + hd) * total + model.offsets[s];
      for (let j = 0; j < count; j++) out[j] += model.weights.data[base + j];
    }
    return out.map((w) => w / heads.length);
  }

  /** The first key step s sees in `layer`: its first key (> 0 once the context slid), or its sliding window's first. */
  function firstKey(model, layer, s) {
    const width = windowOf(model, layer);
    return width === null ? model.starts[s] : Math.max(model.starts[s], model.queries[s] - width + 1);
  }

  /** Key j's weight in step s of `layer`, or null where the step sees no such key (not yet written, out of its context, or before the layer's sliding window). */
  const weightAt = (model, layer, row, s, j) => (j < firstKey(model, layer, s) || j > model.queries[s] ? null : row[j - model.starts[s]]);

  /** Whether some step of some layer masks keys before a sliding window. */
  const windowMasks = (model) => model.queries.some((_, s) => model.windows?.some((_, layer) => firstKey(model, layer, s) > model.starts[s]));

  // ---------- helpers ----------

  /** Cell width, strip height and label margins for `columns` keys. */
  function stripGeometry(columns) {
    const cell = Math.max(2, Math.min(24, Math.floor(900 / columns)));
    const keyLabels = cell >= 10;
    return { cell, height: Math.max(12, Math.min(22, cell)), left: 112, top: keyLabels ? 84 : 30, keyLabels };
  }

  // ---------- the page ----------

  const HASH_NAMES = ["layer", "head", "step"]; // the selection in the address: #layer=l&head=h&step=s, any of them
  const pages = renders();

  /**
   * Build the page for one payload inside `root` (replacing what was there).
   * options.hash (default true): read and write the selection in the URL hash;
   * options.onChange(selection): called with {layer, head, step} after every change;
   * options.idPrefix (default ""): put before every id the page gives its parts (#layer, #strips, ...), so
   * that it can share a page with another view that names its parts alike (the live explorer's Explore);
   * options.headingLevel (default 1): the level of its heading (the model's name), its cards' one below.
   */
  function render(payload, root = document.getElementById("app"), options = {}) {
    const { hash = true, onChange = null, idPrefix = "", headingLevel = 1 } = options;
    const signal = pages.start(root);
    const model = { ...payload, weights: decodeTensor(payload.weights, payload.dtype) };
    model.offsets = stepOffsets(model);
    const steps = model.queries.length;
    const state = { layer: 0, head: 0, step: 0, hover: null, shadeBy: "row" };
    const choose = (changes) => applySelection(state, changes, model, "step", steps);
    choose(payload.selection);
    const cache = new Map();
    const strips = () => {
      const name = `${state.layer}/${state.head}`;
      if (!cache.has(name)) cache.set(name, model.queries.map((_, s) => stepWeights(model, state.layer, state.head, s)));
      return cache.get(name);
    };
    let palette = readPalette();
    const ui = buildLayout(model, (name) => idPrefix + name, headingsFrom(headingLevel));
    root.replaceChildren(ui.page);
    const tokenEls = buildTokens(model, ui.flow);
    const generated = tokenEls.slice(model.n_prompt);

    function update() {
      ui.layer.value = String(state.layer);
      ui.head.value = String(state.head);
      ui.selection.textContent = `layer ${state.layer} · ${headName(state.head)} · new token ${tokenName(model, model.n_prompt + state.step)}`;
      generated.forEach((el, s) => markChosen(el, s === state.step, "aria-selected"));
      draw();
      const { height, top } = stripGeometry(model.tokens.length - 1);
      keepBandInView(ui.map.parentElement, top + state.step * height, height);
      keepTokenInView(ui.flow, generated[state.step]);
      const fragment = `#layer=${state.layer}&head=${state.head}&step=${state.step}`;
      if (hash && location.hash !== fragment) history.replaceState(null, "", fragment); // the address keeps the view
      onChange?.({ layer: state.layer, head: state.head, step: state.step });
    }

    function draw() {
      const largest = drawStrips(ui.map, model, strips(), state, palette);
      describeSlider(ui.map, state.step, steps, describeStrips(model, state, strips()[state.step]));
      fillStepTable(ui, model, state.layer, strips()[state.step], state.step);
      drawLegend(ui.legend, palette, state.shadeBy === "row" ? "each strip's largest" : fmt(largest, 3));
      showStep(state.hover ?? state.step);
    }

    /** The text coloured by step s's weights, and its top keys in the panel. */
    function showStep(s) {
      const row = strips()[s];
      const largest = Math.max(...row) || 1;
      const query = model.queries[s];
      const first = firstKey(model, state.layer, s);
      tokenEls.forEach((el, j) => {
        const w = weightAt(model, state.layer, row, s, j);
        el.classList.toggle("query", j === query);
        el.classList.toggle("pending", j > query + 1);
        el.classList.toggle("masked", j < first);
        paintToken(el, w === null ? null : palette.ramp[Math.round((w / largest) * 0.85 * 255)]);
        const outside = j >= model.starts[s] && j < first ? outsideWindow(query, j, first) : "";
        el.title = w === null ? outside : `weight ${fmt(w)} in the step that chose token ${query + 1}`;
      });
      fillDetail(ui, model, state.layer, row, s, state.hover !== null);
    }

    function select(changes) {
      choose(changes);
      ui.hashNotice.hidden = true; // the address now holds what is shown
      update();
    }

    ui.layer.addEventListener("change", () => select({ layer: ui.layer.value }));
    ui.head.addEventListener("change", () => select({ head: ui.head.value }));
    ui.shadeBy.addEventListener("change", () => select({ shadeBy: ui.shadeBy.value }));
    generated.forEach((el, s) => {
      el.addEventListener("mouseenter", () => ((state.hover = s), showStep(s)));
      el.addEventListener("mouseleave", () => ((state.hover = null), showStep(state.step)));
      el.addEventListener("click", () => select({ step: s }));
    });
    const moveStep = (event) => {
      const step = steppedStep(event, state.step, steps);
      if (step === null) return;
      event.preventDefault();
      select({ step });
      if (event.currentTarget === ui.flow) generated[state.step].focus();
    };
    ui.flow.addEventListener("keydown", moveStep);
    mapKeys(ui.map, moveStep);
    // ← and → with no strip nor token focused (not in a form's field), as Explore's; the other keys scroll the page
    pageKeys(root, (event) => ["ArrowLeft", "ArrowRight"].includes(event.key) && moveStep(event), signal);
    attachStripEvents(ui, model, state, strips, select, showStep);
    onPixelRatioChange(draw, signal);
    onColourChange(() => {
      palette = readPalette();
      draw();
    }, signal);
    /** What the address asks for, over the payload's first selection; a notice for what the page has not. */
    function selectFromHash() {
      const asked = readHash(HASH_NAMES);
      select(asked);
      noteHash(ui.hashNotice, asked, state, model, ["step", "steps", steps]);
    }
    if (hash) window.addEventListener("hashchange", selectFromHash, { signal });
    if (hash) selectFromHash();
    else select({});
    document.title = `${model.model}: attention during generation`;
    root.dataset.ready = "true";
  }

  /** The step a key press on the strips or the generated tokens asks for, or null. */
  function steppedStep(event, step, steps) {
    const target = {
      ArrowDown: step + 1, ArrowRight: step + 1, ArrowUp: step - 1, ArrowLeft: step - 1,
      PageDown: step + 10, PageUp: step - 10, Home: 0, End: steps - 1,
    }[event.key];
    return Number.isInteger(target) ? Math.max(0, Math.min(steps - 1, target)) : null;
  }

  /** The strips' text alternative, for describeSlider: what they show (label) and the chosen strip's strongest key (value). */
  function describeStrips(model, state, row) {
    const s = state.step;
    const best = model.starts[s] + row.indexOf(Math.max(...row));
    return {
      label:
        `${model.queries.length} strips, one per generated token (rows: queries), over ${model.tokens.length - 1} keys ` +
        `(columns: the prompt and the tokens generated before), layer ${state.layer}, ${headName(state.head)}. ` +
        "Arrow keys move the strip, Shift+← → scroll wide strips; the step table lists its weights.",
      value: `Strip ${s}, which chose ${tokenName(model, model.n_prompt + s)}: most weight, ${fmt(Math.max(...row))}, on key ${tokenName(model, best)}.`,
    };
  }

  /** The prompt and its continuation as plain text, in a card of its own (the live explorer's Generate adds to it). */
  function generatedText(model, idOf, heading) {
    return h(
      "section",
      { class: "card" },
      heading(1, { id: idOf("text-heading") }, "Generated text"),
      scrollRegion("p", { id: idOf("text"), class: "text", dir: "auto", "aria-labelledby": idOf("text-heading") }, printable(model.prompt), h("b", {}, printable(model.text))),
    );
  }

  /** The page's parts; `idOf(name)` is the id of the part called `name`, `heading` makes its headings (headingsFrom). */
  function buildLayout(model, idOf, heading) {
    const { layer, head, shadeBy } = buildControls(model, idOf, [["row", "each strip's largest"], ["all", "largest weight"]]);
    const slid = model.starts.some((start) => start > 0);
    const windowed = windowMasks(model);
    const generatedCount = model.queries.length;
    const selection = h("p", { id: idOf("selection"), class: "selection", "aria-live": "polite" });
    const hashNotice = h("p", { id: idOf("hash-notice"), class: "notice", role: "status", hidden: "" });
    const header = h(
      "header",
      {},
      h("div", { class: "brand" }, "selfattn · attention during generation"),
      heading(0, { id: idOf("model") }, model.model),
      h(
        "p",
        { class: "meta" },
        `${model.layers} layers × ${model.heads} heads · ${model.n_prompt} prompt tokens · ${generatedCount} generated`,
        h("span", { class: "badge", id: idOf("axes") }, "rows: queries (the new tokens), columns: keys"),
      ),
      h("div", { class: "controls" }, layer, head, shadeBy),
      selection,
      hashNotice,
    );
    const flow = h("div", { id: idOf("flow"), class: "flow", role: "listbox", "aria-label": "generated tokens", "aria-orientation": "horizontal" });
    const detail = h("div", { id: idOf("detail"), class: "row-summary" }); // follows the pointer: not read out (the selection is)
    const map = h("canvas", { id: idOf("strips"), class: "strips", role: "slider", tabindex: "0" });
    const stepTitle = heading(2, { id: idOf("step-title") });
    const { table: stepTable, body: stepsBody, foot: stepsFoot } = buildStepTable(idOf, []);
    const tip = h("div", { id: idOf("strip-tip"), class: "tip", hidden: "" });
    const greyKeys = [...(slid ? ["outside the model's window"] : []), ...(windowed ? ["before the layer's sliding window (masked)"] : [])];
    const legend = buildLegend(idOf, "strip-legend", greyKeys.join(" or ") || null);
    const page = h(
      "div",
      { class: "page generation" },
      header,
      generatedText(model, idOf, heading),
      h(
        "section",
        { class: "card" },
        heading(1, {}, "Text"),
        h(
          "p",
          { class: "hint" },
          "The prompt, then the generated tokens (underlined; those not yet written at the step shown, dotted). Hover or click a generated token to colour the text by the " +
            "attention that chose it (← → Home End move); its query, the token before it, is outlined.",
        ),
        flow,
        detail,
      ),
      h(
        "section",
        { class: "card" },
        heading(1, {}, "One strip per generated token"),
        h(
          "p",
          { class: "hint", id: idOf("strips-hint") },
          "Rows are queries: one per generation step, named by the token it chose; the query is the token before it. " +
            "Columns are keys: the prompt, then the tokens generated so far (right of the dashed line). " +
            "Each strip sums to 1; to its right, tokens not yet written. Hover a strip for its top keys, click to pin it " +
            "(↑ ↓ move, Shift+← → scroll wide strips)." +
            (slid ? " Past the model's positions the window slides: grey keys are outside it." : "") +
            (windowed ? " The model masks the keys before each layer's sliding window: grey, at weight 0." : ""),
        ),
        h("div", { class: "map-scroll" }, map, tip),
        legend.line,
      ),
      h(
        "section",
        { class: "card" },
        heading(1, { id: idOf("steps-heading") }, "The chosen strip's weights"),
        stepTitle,
        scrollRegion("div", { class: "steps-scroll", "aria-labelledby": idOf("steps-heading") }, stepTable),
      ),
    );
    return { page, idOf, layer, head, shadeBy, selection, hashNotice, flow, detail, map, tip, legend, stepTitle, stepsBody, stepsFoot };
  }

  /** The tokens in the strip `flow`: the generated ones its options; the prompt's, no options, hidden from
   *  screen readers (the plain text and the step table say them). */
  function buildTokens(model, flow) {
    return model.tokens.map((token, j) => {
      const isNew = j >= model.n_prompt;
      const attrs = isNew
        ? { class: "token generated", "data-step": String(j - model.n_prompt), role: "option" }
        : { class: "token prompt", "data-index": String(j), "aria-hidden": "true" };
      const el = tokenSpan(token, attrs);
      flow.append(el);
      return el;
    });
  }

  /** Every key of step s in `layer` with its weight, in the step table: the chosen strip's, never a preview. */
  function fillStepTable(ui, model, layer, row, s) {
    const start = model.starts[s];
    const query = model.queries[s];
    const first = firstKey(model, layer, s);
    const largest = Math.max(...row) || 1;
    ui.stepTitle.textContent = `strip ${s}: new token ${tokenName(model, model.n_prompt + s)}, chosen by query ${tokenName(model, query)}, over keys ${start}..${query}`;
    ui.stepsBody.replaceChildren(
      ...Array.from(row, (weight, r) => {
        const key = start + r;
        const masked = key < first && outsideWindow(query, key, first);
        const spoken = spokenToken(model.tokens[key]);
        return weightRow(key, shown(model.tokens[key]), [], weight, largest, { self: key === query, masked, spoken });
      }),
    );
    ui.stepsFoot.replaceChildren(totalRow(row, 0));
  }

  /** The top keys of step s in `layer` with their weights, and the weight left on the others. */
  function fillDetail(ui, model, layer, row, s, preview) {
    const start = model.starts[s];
    const first = firstKey(model, layer, s);
    const order = [...row.keys()].sort((a, b) => row[b] - row[a]).slice(0, TOP_KEYS).filter((j) => row[j] > 0);
    const head = h(
      "p",
      { class: "summary-head" },
      preview ? "preview: " : "",
      "new token ",
      h("b", {}, tokenName(model, model.n_prompt + s)),
      ` was chosen by query ${tokenName(model, model.queries[s])}, looking at`,
    );
    const key = (j) => start + j;
    const outside = start > 0 ? ` · keys 0..${start - 1} outside the model's window` : "";
    const masked = first > start ? ` · keys ${start}..${first - 1} masked, before the layer's sliding window of ${windowOf(model, layer)} tokens` : "";
    const rest = row.length - (first - start) - order.length; // the keys it sees, not listed
    ui.detail.replaceChildren(head, ...topKeys(ui.idOf, row, order, key, (j) => tokenName(model, key(j)), { rest, allShown: "every key shown", also: outside + masked }));
  }

  // ---------- drawing ----------

  /** Every strip on one canvas (one pixel per cell, scaled up); returns the largest weight. */
  function drawStrips(canvas, model, rows, state, palette) {
    const columns = model.tokens.length - 1; // the last token is never a key
    const steps = rows.length;
    const { cell, height, left, top, keyLabels } = stripGeometry(columns);
    const width = left + columns * cell + (keyLabels ? 60 : 8);
    const tall = top + steps * height + 4;
    canvas.dataset.rows = String(steps);
    canvas.dataset.columns = String(columns);
    const ctx = sizedContext(canvas, width, tall);
    ctx.fillStyle = palette.ground;
    ctx.fillRect(0, 0, width, tall);

    const allLargest = Math.max(...rows.map((row) => Math.max(...row))) || 1;
    const image = new ImageData(columns, steps);
    const ground = channels(palette.ground);
    rows.forEach((row, s) => {
      const largest = state.shadeBy === "row" ? Math.max(...row) || 1 : allLargest;
      for (let j = 0; j < columns; j++) {
        const w = weightAt(model, state.layer, row, s, j);
        const colour = j > model.queries[s] ? ground : w === null ? palette.masked : palette.ramp[Math.round((w / largest) * 255)];
        image.data.set([...colour, 255], 4 * (s * columns + j));
      }
    });
    drawCells(ctx, image, left, top, columns * cell, steps * height);

    // the prompt's last key | the first generated one
    ctx.strokeStyle = palette.label;
    ctx.setLineDash([4, 3]);
    ctx.beginPath();
    ctx.moveTo(left + model.n_prompt * cell + 0.5, top - 4);
    ctx.lineTo(left + model.n_prompt * cell + 0.5, top + steps * height);
    ctx.stroke();
    ctx.setLineDash([]);

    drawAxisNames(ctx, palette);
    ctx.fillStyle = palette.axis;
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    rows.forEach((_, s) => ctx.fillText(`${s} ${clip(shown(model.tokens[model.n_prompt + s]), 10)}`, left - 6, top + (s + 0.5) * height));
    if (keyLabels) {
      for (let j = 0; j < columns; j++) drawKeyLabel(ctx, clip(shown(model.tokens[j]), 10), left + (j + 0.5) * cell, top - 6);
    } else {
      ctx.textAlign = "center";
      const every = [5, 10, 20, 50, 100, 200, 500].find((n) => n * cell >= 28) || 1000;
      for (let j = 0; j < columns; j += every) ctx.fillText(String(j), left + (j + 0.5) * cell, top - 10);
    }
    drawPin(ctx, palette, left, top + state.step * height, columns * cell, height);
    return allLargest;
  }

  function attachStripEvents(ui, model, state, strips, select, showStep) {
    const cellAt = (event) => {
      const { cell, height, left, top } = stripGeometry(model.tokens.length - 1);
      const r = ui.map.getBoundingClientRect();
      const s = Math.floor((event.clientY - r.top - top) / height);
      const j = Math.floor((event.clientX - r.left - left) / cell);
      return s >= 0 && s < model.queries.length ? [s, j] : null;
    };
    attachCellEvents(ui.map, ui.tip, {
      cellAt,
      hover: ([s, j]) => {
        if (state.hover !== s) showStep((state.hover = s)); // the text and the list follow the pointer's strip
        const w = j >= 0 ? weightAt(model, state.layer, strips()[s], s, j) : null;
        const key = w === null ? "" : ` · key ${tokenName(model, j)}: ${fmt(w)}`;
        return `strip ${s} (chose ${tokenName(model, model.n_prompt + s)}, query ${tokenName(model, model.queries[s])})${key}`;
      },
      pick: ([s]) => {
        state.hover = null;
        select({ step: s });
      },
      leave: () => {
        state.hover = null;
        showStep(state.step);
      },
    });
  }

  window.selfattn.generation = { render, clear: pages.clear };
  renderEmbedded("selfattn-generation", render);
})();
