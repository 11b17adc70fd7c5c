// selfattn serve: the live explorer. Four views over the server's JSON API:
//   Explore   POST /api/view     -> view.js's render(payload) (tokens, map, steps, model view)
//   Compare   POST /api/compare  -> the word's cosine similarity per layer, what it attends to
//   Ablation  POST /api/explain  -> the model's weights next to the head recomputed with
//                                   another similarity or scale, and their entropies
//   Generate  POST /api/generate -> generation.js's render(payload): one strip per new token
//                                   (its tab shows for a decoder only)
// What is on screen lives in the address bar (?view=...&text=...&word=...&occurrence=...&layer=...&head=...,
// ?view=generate&prompt=...&n=...&temperature=...&top_k=...&seed=...&layer=...&head=...&step=...),
// so reloading or sharing the address shows the same thing; each run and each tab is a history
// entry, so Back and Forward show each step again. A run asks for exactly what its address says:
// a bad value there is the server's one-line error, never replaced by a default. User text reaches
// the page through textContent only.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const BANK = ["I went to the bank to deposit money.", "We sat on the bank of the river and watched the water."];
  const RETRIES = 3; // on 503 "busy", after the server's Retry-After

  const { h, fmt, fmtScale, printable, shown: asShown, tokenName, scrollRegion } = window.selfattn; // from view.js: DOM building (text only), numbers, a text and a token as shown and as prose names it, a named scroll box

  // ---------- the server ----------

  /** GET (no body) or POST JSON; the server's one-line `detail` becomes the Error's message. */
  async function api(path, body) {
    const init = body === undefined ? {} : { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
    for (let attempt = 0; ; attempt++) {
      const response = await fetch(path, init).catch(() => {
        throw new Error("cannot reach the explorer's server: is `selfattn serve` still running?");
      });
      if (response.status === 503 && attempt < RETRIES) {
        await new Promise((done) => setTimeout(done, 1000 * (+response.headers.get("Retry-After") || 1)));
        continue;
      }
      const data = await response.json().catch(() => ({}));
      if (!response.ok) throw new Error(data.detail || `the server answered ${response.status}`);
      return data;
    }
  }

  /** Show `message` in the element `id`, or hide it when there is none. */
  function say(id, message) {
    $(id).textContent = message || "";
    $(id).hidden = !message;
  }
  const showError = (message) => say("error", message);

  const RESULTS = { explore: "app", compare: "compare-result", ablation: "ablation-result", generate: "generate-result" }; // view -> its result's element
  const TITLES = { explore: "Explore", compare: "Compare a word", ablation: "Similarity & scale", generate: "Generate" }; // as on the tabs
  const tickets = {}; // view -> its latest request
  const failures = {}; // view -> the error its latest request ended in, shown again when its tab opens
  const running = {}; // view -> when its request in flight began (performance.now())
  const SHOW_AFTER = 300; // ms: a run still going then is said on screen
  const COUNT_AFTER = 2; // seconds: a run still going then shows how long it has waited

  /** The open view's run in flight, on screen: what runs and, past a moment, for how long (a slow or stalled server). */
  function showProgress() {
    const since = running[openView];
    const waited = since === undefined ? 0 : performance.now() - since;
    const seconds = Math.floor(waited / 1000);
    const on = since !== undefined && waited >= SHOW_AFTER - 10; // (a timer's own rounding)
    say("progress", on ? `${TITLES[openView]}: running the model…${seconds >= COUNT_AFTER ? ` ${seconds} s` : ""}` : "");
  }
  setInterval(() => openView && running[openView] !== undefined && showProgress(), 1000);

  /** Run `work` for one view: marks its result busy, shows errors, drops answers overtaken by a newer request. */
  async function request(view, work) {
    const target = $(RESULTS[view]);
    const ticket = (tickets[view] = (tickets[view] || 0) + 1);
    shown[view] = params();
    target.dataset.ready = "false";
    target.setAttribute("aria-busy", "true");
    target.inert = true; // the old result, dimmed, takes no clicks: one would write its view into the new run's address and form
    delete failures[view];
    showError("");
    $("status").textContent = `${TITLES[view]}: running the model…`; // for screen readers
    running[view] = performance.now();
    setTimeout(showProgress, SHOW_AFTER); // a quick run shows its result without a line flashing by
    try {
      const data = await work.fetch();
      if (ticket !== tickets[view]) return;
      work.show(data);
      showTitle(); // view.js and generation.js title the page after their own model view
      target.dataset.ready = "true";
      $("status").textContent = `${TITLES[view]}: the result is below.`;
    } catch (error) {
      if (ticket !== tickets[view]) return;
      $("status").textContent = ""; // the alert says what went wrong
      clearResult(view); // no stale result under the error
      failures[view] = error.message;
      target.dataset.ready = "error";
      if (view === openView) showError(error.message);
    } finally {
      if (ticket === tickets[view]) {
        target.removeAttribute("aria-busy");
        target.inert = false;
        delete running[view];
        showProgress();
      }
    }
  }

  /** Take a view's result off screen, and drop any answer still on its way. */
  function clearResult(view) {
    const target = $(RESULTS[view]);
    tickets[view] = (tickets[view] || 0) + 1;
    delete shown[view];
    delete failures[view];
    if (view === openView) showError("");
    (view === "generate" ? window.selfattn.generation : window.selfattn).clear(target);
    target.removeAttribute("aria-busy");
    target.inert = false;
    delete target.dataset.ready;
    delete running[view];
    if (view === openView) showProgress();
  }

  // ---------- the address bar ----------

  // An entry's address names its view and that view's inputs; the view's result is requested again
  // from them, except in an entry marked idle (a tab opened on a view with no result).

  const params = () => new URLSearchParams(location.search);
  const shown = {}; // view -> the parameters of the result it shows: its tab opens them again

  /** Change some of `base`'s parameters in place; null or "" removes one. The address they make. */
  function addressWith(changes, base = params()) {
    for (const [name, value] of Object.entries(changes)) {
      base.delete(name);
      for (const item of [value].flat()) if (item !== null && item !== undefined && item !== "") base.append(name, String(item));
    }
    return `${location.pathname}?${base}`;
  }
  /** The address of a view and exactly its form's inputs. */
  const inputsAddress = (view) => addressWith({ view, ...inputs(view) }, new URLSearchParams());
  /** A new history entry for a submitted form. */
  const navigate = (view) => history.pushState(null, "", inputsAddress(view));

  const NUMBER = /^-?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$/i; // as a number field writes one

  /**
   * The API fields `names` as the address `p` gives them: a number where the value reads as one,
   * else the value as given, for the server to refuse in one line rather than the page to drop it
   * (and run a default instead). A field that is absent or empty is left out.
   */
  function addressFields(p, names) {
    const fields = {};
    for (const name of names) {
      const value = p.get(name);
      if (value) fields[name] = NUMBER.test(value) && Number.isFinite(+value) ? +value : value;
    }
    return fields;
  }

  /** A run from an address without a word says so here, in the view's own terms: the server's message offers a token index too, which Compare and Similarity & scale have not. */
  function requireWord(word, why) {
    if (!word) throw new Error(`give a word: ${why}`);
  }

  // ---------- Explore ----------

  async function explore(fromAddress) {
    const { text, word } = inputs("explore");
    if (!fromAddress) navigate("explore"); // its address has no layer, head nor index: the server chooses them
    // the address exactly: which match of the word, its layer and head, the query token (never with a
    // word: the page's own addresses hold one or the other, so the server refuses both in one line)
    const body = { text, ...addressFields(params(), ["occurrence", "layer", "head", "index"]) };
    if (word) body.word = word;
    await request("explore", {
      fetch: () => api("/api/view", body),
      show: (payload) => {
        if (body.head === "mean") payload.selection.head = "mean"; // the payload names heads by number
        const wordQuery = body.word ? payload.selection.query : null;
        // What the server chose, while shown as it chose it, stays out of the address: that
        // address (reloaded, shared) has it chosen again, with the "chosen: ..." line saying why.
        const first = payload.selection;
        const serverChose = body.layer === undefined || body.head === undefined;
        window.selfattn.render(payload, $("app"), {
          hash: false,
          headingLevel: 3, // under the page's h1 and the view's h2
          onChange: ({ layer, head, query }) => {
            // the word's match as the query: the word and its occurrence; any other token: its index
            const byWord = query === wordQuery;
            const chosen = byWord ? { word: body.word, occurrence: body.occurrence, index: null } : { word: null, occurrence: null, index: query };
            const asChosen = serverChose && layer === first.layer && head === first.head && query === first.query;
            const view = asChosen ? { layer: body.layer ?? null, head: body.head ?? null } : { layer, head };
            const address = addressWith({ ...view, ...chosen }, shown.explore);
            if (openView === "explore") history.replaceState(null, "", address);
            $("explore-word").value = chosen.word ?? "";
            $("explore-occurrence").value = chosen.occurrence ?? "";
          },
        });
      },
    });
  }

  // ---------- Compare ----------

  function sentenceInputs() {
    return [...document.querySelectorAll("#compare-sentences .compare-sentence")];
  }

  function addSentence(value = "") {
    const inputs = sentenceInputs();
    if (inputs.length >= limits().max_sentences) return;
    const input = h("input", { class: "compare-sentence", autocomplete: "off", dir: "auto" }); // named by renumber()
    limitText(input, $("compare-sentences-limit")); // the server's limit on a text, said under the sentences
    input.value = value;
    const remove = h("button", { type: "button", class: "secondary remove" }, "×"); // named by renumber()
    const row = h("div", { class: "sentence-row" }, h("span", { class: "label" }, `S${inputs.length + 1}`), input, remove);
    remove.addEventListener("click", () => {
      const next = row.nextElementSibling ?? row.previousElementSibling;
      removeSentence(row);
      next.querySelector(".compare-sentence").focus(); // the keyboard stays on the sentences, not thrown to the page's start
    });
    $("compare-sentences").append(row);
    renumber();
  }

  /** Take a sentence's row off the form (two rows stay) and number the others again. */
  function removeSentence(row) {
    if (sentenceInputs().length > 2) row.remove();
    renumber();
    // the limit's notice is for a sentence still there
    if (!sentenceInputs().some((input) => input.value.length >= input.maxLength)) say("compare-sentences-limit", "");
  }

  /** Number the rows again; their "×" is off (its title says why) while two rows are left. */
  function renumber() {
    const rows = [...document.querySelectorAll("#compare-sentences .sentence-row")];
    const removable = rows.length > 2;
    rows.forEach((row, i) => {
      row.querySelector(".label").textContent = `S${i + 1}`;
      row.querySelector(".compare-sentence").setAttribute("aria-label", `sentence ${i + 1}`);
      const remove = row.querySelector(".remove");
      remove.setAttribute("aria-label", `remove sentence ${i + 1}`);
      remove.disabled = !removable;
      remove.title = removable ? `remove sentence ${i + 1}` : "Compare needs at least two sentences";
    });
    $("compare-add").disabled = rows.length >= limits().max_sentences;
  }

  /** The form's sentences: the first few (the server's limit, said when more are given), at least two. */
  function setSentences(sentences) {
    const most = limits().max_sentences;
    sentences = sentences.filter((sentence) => sentence.trim()); // an empty s= takes no place among them
    const more = sentences.length - most;
    $("compare-sentences").replaceChildren();
    for (const sentence of sentences.slice(0, most)) addSentence(sentence);
    while (sentenceInputs().length < 2) addSentence();
    say("compare-sentences-limit", ""); // said of a sentence no longer there
    say("compare-notice", more > 0 ? `The explorer compares at most ${most} sentences: ${more} more left out.` : "");
  }

  async function compare(fromAddress) {
    const { s: sentences, word } = inputs("compare");
    for (const input of sentenceInputs()) if (!input.value.trim()) removeSentence(input.parentElement); // S2 is then the same sentence in the form and in the result
    if (!fromAddress) navigate("compare");
    // an address of more sentences than the server compares keeps those shown, run and said: a reload shows them with nothing left out
    else if (params().getAll("s").filter((s) => s.trim()).length > limits().max_sentences) history.replaceState(history.state, "", addressWith({ s: sentences }));
    const body = { sentences, word, ...addressFields(params(), ["occurrence"]) };
    await request("compare", {
      fetch: async () => {
        requireWord(word, "Compare follows one word across the sentences");
        return api("/api/compare", body);
      },
      show: showComparison,
    });
  }

  function showComparison(data) {
    const n = data.sentences.length;
    const pairs = [];
    for (let a = 0; a < n; a++) for (let b = a + 1; b < n; b++) pairs.push([a, b]);
    const table = h(
      "table",
      { id: "compare-table", class: "grid-table", "aria-labelledby": "compare-table-title" },
      h("thead", {}, h("tr", {}, h("th", {}, "layer"), ...pairs.map(([a, b]) => h("th", {}, `S${a + 1} vs S${b + 1}`)))),
      h(
        "tbody",
        {},
        ...data.layers.map(({ layer, cosine }) =>
          h(
            "tr",
            { "data-layer": String(layer) },
            h("td", { class: "num" }, String(layer)),
            ...pairs.map(([a, b]) => {
              const cell = h("td", { class: "num cosine", "data-pair": `${a}-${b}`, "data-value": String(cosine[a][b]) }, fmt(cosine[a][b], 3));
              cell.style.setProperty("--level", String(Math.max(0, Math.min(1, cosine[a][b]))));
              return cell;
            }),
          ),
        ),
      ),
    );
    const attended = h(
      "ol",
      { id: "compare-attended", class: "attended" },
      ...data.sentences.map((sentence, i) =>
        h(
          "li",
          { "data-sentence": String(i) },
          h("span", { class: "label" }, `S${i + 1}`),
          h("span", { class: "sentence", dir: "auto" }, printable(sentence)),
          h(
            "span",
            { class: "looks" },
            `“${data.word}” attends to: `,
            ...(data.attended[i].length ? data.attended[i].map(chip) : [data.causal ? "no word before it" : "no other word"]),
          ),
        ),
      ),
    );
    $("compare-result").replaceChildren(
      h(
        "section",
        { class: "card" },
        h("h2", {}, `“${data.word}”${occurrenceLabel(data.occurrence)} across ${n} sentences`),
        attended,
        h("p", { id: "compare-note", class: "hint" }, attentionNote(data)),
        h("h3", { id: "compare-table-title" }, "cosine similarity of its vectors, layer by layer"),
        h("p", { class: "hint" }, "layer 0 = the embedding output (the same token differs there only by its position, where the model adds one there); 1.000 = the same direction"),
        scrollRegion("div", { class: "table-scroll", "aria-labelledby": "compare-table-title" }, table),
        ...(data.tokens_note ? [h("p", { id: "compare-tokens-note", class: "note" }, data.tokens_note)] : []),
      ),
    );
  }

  /** Which match of the word was followed, where not the first: " (occurrence 1)", " (last occurrence)". */
  const occurrenceLabel = (occurrence) => (occurrence === 0 ? "" : occurrence === -1 ? " (last occurrence)" : ` (occurrence ${occurrence})`);

  /** One word the compared word attends to, with its weight. */
  const chip = ({ word, label, weight }) => h("span", { class: "chip", "data-word": word, "data-weight": String(weight) }, label, " ", h("b", {}, fmt(weight, 2)));

  /** How "attends to" was read, and what its lists leave out (as `selfattn compare` notes it). */
  function attentionNote(data) {
    const layer = data.attended_layer;
    const notes = [`attention: attention layer ${layer} (the Explore view's layer ${layer}; its block's output is layer ${layer + 1} in the table below), mean of heads, word pieces merged; the word itself and special tokens left out`];
    if (data.attended.flat().some(({ word, label }) => label !== word)) notes.push("n:word = the word at token n, where a sentence has it more than once");
    if (data.causal) notes.push("a decoder: the word's vectors and attention see only the text up to it, so words after it change nothing");
    return notes.join("; ");
  }

  // ---------- Similarity & scale ----------

  const SIMILARITY = "cosine"; // the form's choice when the address names none

  async function ablation(fromAddress) {
    const { text, word } = inputs("ablation");
    if (!fromAddress) navigate("ablation");
    const chosen = addressFields(params(), ["similarity", "layer", "head", "scale", "occurrence"]);
    const body = { text, word, similarity: SIMILARITY, ...chosen };
    await request("ablation", {
      fetch: async () => {
        requireWord(word, "Similarity & scale recomputes the weights of one word as the query");
        return api("/api/explain", body);
      },
      show: showAblation,
    });
  }

  const bits = (steps) => fmt(steps.entropy_bits, 3); // an entropy as the page shows it

  function entropyLine(id, label, steps) {
    const how = steps.similarity === "cosine" ? "cosine" : "dot product";
    return h("p", { class: "entropy" }, h("b", {}, label), ` ${how}, scale ${fmtScale(steps.scale)} · entropy `, h("b", { id, "data-value": String(steps.entropy_bits) }, `${bits(steps)} bits`));
  }

  /** The recomputed weights against the model's by their entropies as shown, as the terminal's report words it: the same digits are "as spread as". */
  function spreadVerdict(own, alt) {
    if (bits(alt) === bits(own)) return "as spread as";
    return alt.entropy_bits < own.entropy_bits ? "sharper than" : "flatter than";
  }

  function showAblation(data) {
    const alt = data.alternative;
    const own = { similarity: data.similarity, scale: data.scale, entropy_bits: data.entropy_bits };
    const largest = Math.max(...data.weights, ...alt.weights) || 1;
    const bar = (w, cls) => {
      const fill = h("span", { class: `bar ${cls}` });
      fill.style.width = `${(w / largest) * 100}%`;
      return h("td", { class: "bar-cell" }, h("span", { class: "bar-track" }, fill));
    };
    // Keys the query may not attend (a decoder's later tokens, those before a sliding window):
    // named as masked, not shown as 0.000 weights the model gave.
    const masked = new Set(data.masked_keys || []);
    const weight = (w, j) => (masked.has(j) ? "masked" : fmt(w));
    const rows = data.names.map((name, j) =>
      h(
        "tr",
        {
          "data-key": String(j),
          class: [j === data.query.index ? "self" : "", masked.has(j) ? "masked" : ""].join(" ").trim(),
          ...(masked.has(j) ? { title: `masked: query ${data.query.index} may not attend key ${j}; weight 0 in both` } : {}),
        },
        h("td", { class: "key" }, h("span", { class: "idx" }, String(j)), " ", asShown(name)),
        h("td", { class: "num", "data-model": String(data.weights[j]) }, weight(data.weights[j], j)),
        bar(data.weights[j], "model"),
        h("td", { class: "num strong", "data-recomputed": String(alt.weights[j]) }, weight(alt.weights[j], j)),
        bar(alt.weights[j], "recomputed"),
      ),
    );
    const barHeader = () => h("td", { class: "bar-cell", "aria-hidden": "true" }); // over the bars: nothing to read
    const verdict = spreadVerdict(own, alt);
    const head = data.head === "mean" ? "mean of heads" : `head ${data.head}`;
    $("ablation-result").replaceChildren(
      h(
        "section",
        { class: "card" },
        h("h2", { id: "ablation-title" }, `query ${tokenName(data, data.query.index)} · layer ${data.layer}, ${head}`),
        ...(data.query.note ? [h("p", { id: "ablation-note", class: "note" }, data.query.note)] : []), // a piece of the word, or a phrase's first token
        h("p", { class: "hint" }, data.choice),
        entropyLine("ablation-entropy-model", "the model:", own),
        entropyLine("ablation-entropy-recomputed", "recomputed:", alt),
        h("p", { id: "ablation-verdict", class: "verdict" }, `recomputed weights are ${verdict} the model's`),
        scrollRegion(
          "div",
          { class: "steps-scroll", "aria-labelledby": "ablation-title" },
          h(
            "table",
            { id: "ablation-table", class: "grid-table", "aria-labelledby": "ablation-title" },
            h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "key"), h("th", { scope: "col" }, "model"), barHeader(), h("th", { scope: "col" }, "recomputed"), barHeader())),
            h("tbody", {}, ...rows),
          ),
        ),
      ),
    );
  }

  // ---------- Generate ----------

  async function generate(fromAddress) {
    const { prompt } = inputs("generate");
    if (!fromAddress) navigate("generate"); // its address has no layer, head nor step: the server's first ones
    const { n, ...fields } = addressFields(params(), ["n", "temperature", "top_k", "seed", "layer", "head", "step"]);
    const body = { prompt, ...fields };
    if (n !== undefined) body.max_new_tokens = n;
    await request("generate", {
      fetch: () => api("/api/generate", body),
      show: (payload) => {
        const app = h("div", { id: "generate-app", class: "app" });
        $("generate-result").replaceChildren(app);
        window.selfattn.generation.render(payload, app, {
          hash: false,
          headingLevel: 3, // under the page's h1 and the view's h2
          idPrefix: "generate-", // its parts' ids (#generate-layer, ...) apart from Explore's (#layer, ...)
          onChange: ({ layer, head, step }) => {
            if (openView === "generate") history.replaceState(null, "", addressWith({ layer, head, step }, shown.generate));
          },
        });
        $("generate-text").after(h("p", { id: "generate-repeat", class: "notice" }, repeatNote(body))); // under the page's text of prompt and continuation
      },
    });
  }

  /** With a seed, or temperature 0 (greedy), the same address gives the same text; without, a reload samples anew. */
  function repeatNote({ seed, temperature }) {
    if (temperature === 0) return "Temperature 0 (greedy): reloading this address gives the same text.";
    if (seed !== undefined) return `Seed ${seed}: reloading this address gives the same text.`;
    return "No seed: reloading this address samples anew, another text. Give a seed to keep one.";
  }

  // ---------- tabs, forms, start-up ----------

  let info = null; // GET /api/models
  const limits = () => info.limits;
  const VIEWS = { explore, compare, ablation, generate };
  let openView = null; // the view on screen

  /**
   * Each view's form fields by the address parameters they hold, in the address's order: the field of
   * `name` is #view-name (top_k: #generate-top-k). Compare's sentences go before them, from their own inputs.
   */
  const FIELDS = {
    explore: ["text", "word", "occurrence"],
    compare: ["word", "occurrence"],
    ablation: ["text", "word", "occurrence", "similarity", "layer", "head", "scale"],
    generate: ["prompt", "n", "temperature", "top_k", "seed"],
  };
  const field = (view, name) => $(`${view}-${name.replace("_", "-")}`);

  /** A view's form, as address parameters (its word without the spaces around it). */
  function inputs(view) {
    const values = view === "compare" ? { s: sentenceInputs().map((input) => input.value).filter((s) => s.trim()) } : {};
    for (const name of FIELDS[view]) values[name] = name === "word" ? field(view, name).value.trim() : field(view, name).value;
    return values;
  }

  /** A view's form, filled from address parameters `p`. */
  function fill(view, p) {
    if (view === "compare") {
      const sentences = p.getAll("s");
      setSentences(sentences.length || p.get("view") === "compare" ? sentences : BANK);
    }
    // a value that a select does not offer leaves it blank (the error says why), not on the last choice;
    // a number field shows a value that is not a number as blank
    for (const name of FIELDS[view]) field(view, name).value = p.get(name) || (name === "similarity" ? SIMILARITY : "");
  }

  /** The field after a view's word that picks which match of the word is the query. */
  function addOccurrenceField(view) {
    const input = h("input", { id: `${view}-occurrence`, type: "number", step: "1", placeholder: "0" });
    $(`${view}-word`).closest("label").after(h("label", {}, "Occurrence (0 = first, -1 = last) ", input));
  }

  function showView(view) {
    openView = view;
    showError(failures[view]); // an error belongs to the view it came from
    showProgress(); // and so does a run in flight
    showTitle(); // and the window's title
    for (const name of Object.keys(VIEWS)) {
      $(`view-${name}`).hidden = name !== view;
      $(`tab-${name}`).classList.toggle("active", name === view);
      $(`tab-${name}`).setAttribute("aria-pressed", String(name === view));
    }
  }

  /** The window's title (its tab, its history entries): the view on screen and the model, once known. */
  function showTitle() {
    document.title = [TITLES[openView], info?.models[0].name, "selfattn web explorer"].filter(Boolean).join(" · ");
  }

  function describeModel() {
    const model = info.models[0];
    $("model-info").textContent = `${model.name} · ${model.kind} · ${model.layers} layers × ${model.heads} heads · up to ${model.max_positions} tokens`;
    for (const id of ["explore-text", "ablation-text", "generate-prompt"]) {
      const notice = h("p", { id: `${id}-limit`, class: "notice wide", role: "status", hidden: "" });
      $(id).closest("label").after(notice);
      limitText($(id), notice);
    }
    $("tab-generate").hidden = model.kind !== "decoder"; // the API refuses Generate for an encoder in one line
    $("generate-n").max = String(limits().max_new_tokens);
    $("generate-n").title = `at most ${limits().max_new_tokens} new tokens a run`;
    for (let l = 0; l < model.layers; l++) $("ablation-layer").append(h("option", { value: String(l) }, `layer ${l}`));
    for (let i = 0; i < model.heads; i++) $("ablation-head").append(h("option", { value: String(i) }, `head ${i}`));
  }

  /**
   * The server's limit on a text, for the field `input`; the browser cuts a longer paste (or typing) there
   * without a word, so the element `notice` (Compare's sentences share one) says so, until the next edit:
   * shown when an edit inserts more than the room left, never for a text that fits, one of exactly the limit included.
   */
  function limitText(input, notice) {
    const most = limits().max_chars;
    input.setAttribute("aria-describedby", notice.id);
    input.maxLength = most;
    input.addEventListener("beforeinput", (event) => {
      const { value, selectionStart, selectionEnd } = input;
      const inserted = (event.data ?? event.dataTransfer?.getData("text/plain") ?? "").replace(/\r\n?/g, "\n"); // a line break counts one
      const cut = inserted.length > most - value.length + (selectionEnd - selectionStart);
      say(notice.id, cut ? `${most.toLocaleString("en")} characters at most: the rest of a longer text is left out.` : "");
    });
  }

  /** Whether the page offers `view` (not "constructor", say): one of its views, with its tab shown (Generate's for a decoder only). */
  const offered = (view) => Object.hasOwn(VIEWS, view) && !$(`tab-${view}`).hidden;

  /**
   * Show the address's view: its form from the address, and its result requested again when the
   * address has what it needs (none in an idle entry). The first load fills every view's form (a
   * shared text or word carries over); Back and Forward leave the other views as they are. A view
   * the page does not offer shows Explore; Generate on an encoder, with the server's line on why.
   */
  function fromAddress(first) {
    const p = params();
    const asked = p.get("view");
    const view = offered(asked) ? asked : "explore";
    for (const name of first ? Object.keys(VIEWS) : [view]) fill(name, p);
    showView(view);
    // without a word, compare and ablation say they need one; with one sentence, compare the server's line on how many it takes
    const ready = { explore: p.get("text"), compare: p.getAll("s").length >= 1, ablation: p.get("text"), generate: p.get("prompt") };
    if (ready[view] && !history.state?.idle) VIEWS[view](true);
    else clearResult(view);
    if (asked === "generate" && view !== asked) api("/api/generate", { prompt: p.get("prompt") ?? "" }).catch((error) => showError(error.message)); // the server refuses an encoder first
  }

  /** A tab: a new history entry with what its view shows, or its form's inputs alone (idle) when it shows no result. */
  function openTab(view) {
    if (view === openView) return;
    if (shown[view]) history.pushState(null, "", addressWith({}, shown[view]));
    else history.pushState({ idle: true }, "", inputsAddress(view));
    showView(view);
  }

  function start() {
    for (const name of ["explore", "compare", "ablation"]) addOccurrenceField(name); // the views with a word
    for (const name of Object.keys(VIEWS)) {
      $(`tab-${name}`).addEventListener("click", () => openTab(name));
      $(`${name}-form`).addEventListener("submit", (event) => {
        event.preventDefault();
        VIEWS[name](false);
      });
    }
    $("compare-add").addEventListener("click", () => {
      addSentence();
      sentenceInputs().at(-1).focus(); // type it at once; the button, off at the limit, takes no focus with it
    });
    $("compare-bank").addEventListener("click", () => {
      setSentences(BANK);
      $("compare-word").value = "bank";
    });
    window.addEventListener("popstate", () => fromAddress(false));
    api("/api/models")
      .then((data) => {
        info = data;
        describeModel();
        fromAddress(true);
        document.body.dataset.ready = "true";
      })
      .catch((error) => showError(error.message));
  }

  start();
})();
